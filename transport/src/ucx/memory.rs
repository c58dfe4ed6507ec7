//! [`MemoryRegion`]: memory registered with (or allocated by) UCX for RMA.

use std::rc::Rc;

use super::context::{Context, ContextInner};
use super::sys;
use super::UcxError;

/// Where a region's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryType {
    /// Host memory (`UCS_MEMORY_TYPE_HOST`).
    Host,
    /// CUDA device memory (`UCS_MEMORY_TYPE_CUDA`); needs a UCX built with CUDA.
    Cuda,
}

impl MemoryType {
    fn raw(self) -> sys::ucs_memory_type_t {
        match self {
            Self::Host => sys::UCS_MEMORY_TYPE_HOST,
            Self::Cuda => sys::UCS_MEMORY_TYPE_CUDA,
        }
    }
}

/// A UCX memory registration (`ucp_mem_map` ... `ucp_mem_unmap`).
///
/// Made on a [`Context`] by [`MemoryRegion::allocate`] (UCX allocates: for host memory the
/// shared-memory transports can then map it into a peer directly, an order of magnitude
/// faster than registered heap memory between processes on one host) or by
/// [`MemoryRegion::register_owned`] / [`MemoryRegion::register`]. Its
/// [`MemoryRegion::pack_rkey`] bytes go to peers, which write or read it by address
/// ([`MemoryRegion::address`]). Keeps its context alive; unmapped on drop.
pub struct MemoryRegion {
    ctx: Rc<ContextInner>,
    memh: sys::ucp_mem_h,
    ptr: *mut u8,
    len: usize,
    mem_type: MemoryType,
    /// Heap memory we registered and own; freed after `ucp_mem_unmap` (field order: drop
    /// runs `Drop::drop` first, then the fields).
    _owned: Option<Box<[u8]>>,
    /// Registered host memory not inherited by a forked child (`MADV_DONTFORK`, as verbs
    /// registrations are), where UCX is old enough that peers' keys are vetted in one
    /// (`rkey::vet`): a fork would otherwise mark every page copy-on-write, and the next
    /// write to each (a transfer, the engine's own) would fault. Undone on drop.
    dontfork: bool,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("address", &self.ptr)
            .field("len", &self.len)
            .field("mem_type", &self.mem_type)
            .field("owned", &self._owned.is_some())
            .finish_non_exhaustive()
    }
}

impl MemoryRegion {
    /// Asks UCX to allocate and register `len` bytes of `mem_type` memory
    /// (`UCP_MEM_MAP_ALLOCATE`). The contents start unspecified.
    pub fn allocate(ctx: &Context, len: usize, mem_type: MemoryType) -> Result<Self, UcxError> {
        if len == 0 {
            return Err(UcxError::InvalidArgument {
                what: "zero-length memory region".into(),
            });
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS
                | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            address: std::ptr::null_mut(),
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            prot: 0,
            memory_type: mem_type.raw(),
        };
        Self::map(ctx, &params, mem_type, None)
    }

    /// Registers a host buffer that the region then owns (freed after unmapping).
    pub fn register_owned(ctx: &Context, mut buffer: Box<[u8]>) -> Result<Self, UcxError> {
        if buffer.is_empty() {
            return Err(UcxError::InvalidArgument {
                what: "zero-length memory region".into(),
            });
        }
        let params = Self::register_params(buffer.as_mut_ptr(), buffer.len(), MemoryType::Host);
        Self::map(ctx, &params, MemoryType::Host, Some(buffer))
    }

    /// Registers existing memory (host, or CUDA device memory from the `gpu` crate).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid memory of `mem_type` that stays allocated, and is not
    /// accessed through Rust references, for as long as the region lives (peers may write
    /// it at any time).
    pub unsafe fn register(
        ctx: &Context,
        ptr: *mut u8,
        len: usize,
        mem_type: MemoryType,
    ) -> Result<Self, UcxError> {
        if len == 0 || ptr.is_null() {
            return Err(UcxError::InvalidArgument {
                what: "null or zero-length memory region".into(),
            });
        }
        let params = Self::register_params(ptr, len, mem_type);
        Self::map(ctx, &params, mem_type, None)
    }

    fn register_params(
        ptr: *mut u8,
        len: usize,
        mem_type: MemoryType,
    ) -> sys::ucp_mem_map_params_t {
        sys::ucp_mem_map_params_t {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            address: ptr.cast(),
            length: len,
            flags: 0,
            prot: 0,
            memory_type: mem_type.raw(),
        }
    }

    fn map(
        ctx: &Context,
        params: &sys::ucp_mem_map_params_t,
        mem_type: MemoryType,
        owned: Option<Box<[u8]>>,
    ) -> Result<Self, UcxError> {
        let inner = &ctx.inner;
        let api = inner.api;
        let mut memh = std::ptr::null_mut();
        // SAFETY: live context; `params` is a 1.13 layout with only 1.13 fields flagged;
        // registered memory is valid per the callers' contracts; `memh` written on OK.
        let status = unsafe { (api.ucp_mem_map)(inner.handle, params, &mut memh) };
        api.check("ucp_mem_map", status)?;
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH,
            address: std::ptr::null_mut(),
            length: 0,
            mem_type: 0,
        };
        // SAFETY: `memh` was just mapped; `attr` is a valid out-parameter.
        let status = unsafe { (api.ucp_mem_query)(memh, &mut attr) };
        // A registration is addressed where the caller's memory is (UCX may report a
        // larger, aligned registration around it); an allocation where UCX put it.
        let registered = params.flags & sys::UCP_MEM_MAP_ALLOCATE == 0;
        let region = Self {
            ctx: Rc::clone(inner),
            memh,
            ptr: if registered {
                params.address.cast()
            } else {
                attr.address.cast()
            },
            len: params.length,
            mem_type,
            _owned: owned,
            dontfork: registered
                && mem_type == MemoryType::Host
                && super::rkey::needs_vetting(api.version),
        };
        if region.dontfork {
            fork_advice(region.ptr, region.len, libc::MADV_DONTFORK);
        }
        api.check("ucp_mem_query", status)?;
        let (start, end) = (
            attr.address as u64,
            (attr.address as u64).saturating_add(attr.length as u64),
        );
        let wanted = region.ptr as u64;
        if region.ptr.is_null()
            || wanted < start
            || wanted.saturating_add(params.length as u64) > end
        {
            return Err(UcxError::InvalidArgument {
                what: format!(
                    "ucp_mem_query returned {} bytes at {:p}, which do not cover {} bytes at {:p}",
                    attr.length, attr.address, params.length, region.ptr
                ),
            });
        }
        Ok(region)
    }

    /// The region's start as a virtual address (what a peer passes as `remote_addr`).
    pub fn address(&self) -> u64 {
        self.ptr as u64
    }

    /// The region's start as a pointer, for code that fills it (e.g. a GPU copy).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty regions are refused at creation.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host or CUDA.
    pub fn memory_type(&self) -> MemoryType {
        self.mem_type
    }

    /// The remote key to give peers (`ucp_rkey_pack`), to pass to
    /// [`super::Endpoint::unpack_rkey`] on their side.
    pub fn pack_rkey(&self) -> Result<Vec<u8>, UcxError> {
        let api = self.ctx.api;
        let mut buffer = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: live context and registration; out-parameters are valid.
        let status =
            unsafe { (api.ucp_rkey_pack)(self.ctx.handle, self.memh, &mut buffer, &mut size) };
        api.check("ucp_rkey_pack", status)?;
        // SAFETY: on OK, `buffer` holds `size` bytes owned by UCX until released below.
        let bytes = unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), size) }.to_vec();
        // SAFETY: released once, after copying.
        unsafe { (api.ucp_rkey_buffer_release)(buffer) };
        Ok(bytes)
    }

    /// Checks `offset..offset+len` lies in the region and returns the pointer to `offset`.
    pub(crate) fn range_ptr(&self, offset: usize, len: usize) -> Result<*mut u8, UcxError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                // SAFETY: `offset < len of the region` (or `== len` with `len == 0`), so the
                // result stays inside (or one past) the mapped allocation.
                Ok(unsafe { self.ptr.add(offset) })
            }
            _ => Err(UcxError::OutOfRange {
                what: "local region",
                offset: offset as u64,
                len: len as u64,
                limit: self.len as u64,
            }),
        }
    }

    fn host_range(&self, offset: usize, len: usize) -> Result<*mut u8, UcxError> {
        if self.mem_type != MemoryType::Host {
            return Err(UcxError::NotHostMemory {
                found: self.mem_type,
            });
        }
        self.range_ptr(offset, len)
    }

    /// Copies `data` into host memory at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), UcxError> {
        let dst = self.host_range(offset, data.len())?;
        // SAFETY: range checked to lie in the mapped host region; `data` is a separate Rust
        // buffer, so the two cannot overlap. No Rust reference to region memory exists.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies host memory at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), UcxError> {
        let src = self.host_range(offset, out.len())?;
        // SAFETY: as in `write`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    pub(crate) fn memh(&self) -> sys::ucp_mem_h {
        self.memh
    }

    pub(crate) fn context(&self) -> &Rc<ContextInner> {
        &self.ctx
    }
}

/// Gives `advice` (`MADV_DONTFORK` or `MADV_DOFORK`) for the whole pages inside
/// `[ptr, ptr + len)`; best effort (a mapping that refuses it is left as it is).
fn fork_advice(ptr: *mut u8, len: usize, advice: libc::c_int) {
    const PAGE: usize = 4096;
    let start = (ptr as usize).div_ceil(PAGE) * PAGE;
    let end = (ptr as usize).saturating_add(len) / PAGE * PAGE;
    if end > start {
        // SAFETY: advice about whole pages of a range the caller registered and keeps
        // mapped; it changes only whether a forked child inherits them.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if self.dontfork {
            fork_advice(self.ptr, self.len, libc::MADV_DOFORK);
        }
        let api = self.ctx.api;
        // SAFETY: `memh` came from `ucp_mem_map` on this context, which the `Rc` keeps
        // alive; our operations never outlive their call (timeouts force-close the
        // endpoint, cancelling them), so nothing in flight still uses the memory.
        let status = unsafe { (api.ucp_mem_unmap)(self.ctx.handle, self.memh) };
        if status != sys::UCS_OK {
            tracing::warn!(status = %api.status_string(status), "ucp_mem_unmap failed");
        }
    }
}
