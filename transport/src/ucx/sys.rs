//! Raw libucp: hand-written `#[repr(C)]` types, constants, and a table of function pointers
//! resolved with `libloading` at run time.
//!
//! Nothing here needs UCX headers to build. Layouts follow the UCX 1.13 headers
//! (`ucp/api/ucp.h`, `ucp/api/ucp_def.h`, `ucs/type/status.h`); parameter structs only grow
//! by appending fields selected with a `field_mask` bit, so a 1.13 layout with only 1.13
//! bits set is read correctly by every later 1.x library (checked against 1.22).
//!
//! Load order (see [`api`]): `HANDOFF_UCX_LIB` (a path to `libucp.so*` or a directory
//! holding it), else `libucp.so.0` then `libucp.so` through the system loader. The loaded
//! table is cached for the life of the process; [`load_from`] loads without caching, so a
//! missing library can be tested in a process where another test loaded the real one.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::UcxError;

/// `ucs_status_t`. The C enum is declared `UCS_S_PACKED` (`__attribute__((packed))`), so it
/// is ONE byte wide: every function returning a status returns it in `al`, and callbacks
/// receive a one-byte argument. Declaring it `c_int` would read garbage upper bits.
pub type ucs_status_t = i8;
/// `ucs_status_ptr_t`: a request pointer, NULL for "done at once", or an error code cast to
/// a pointer (see [`ptr_is_err`]).
pub type ucs_status_ptr_t = *mut c_void;
/// `ucs_memory_type_t` (a plain C enum: `int` sized).
pub type ucs_memory_type_t = c_uint;
/// `ucs_thread_mode_t` (a plain C enum).
pub type ucs_thread_mode_t = c_uint;
/// `ucp_err_handling_mode_t` (a plain C enum).
pub type ucp_err_handling_mode_t = c_uint;
/// `ucp_datatype_t`.
pub type ucp_datatype_t = u64;

/// Opaque `struct ucp_context`.
#[repr(C)]
pub struct ucp_context {
    _private: [u8; 0],
}
/// Opaque `struct ucp_config`.
#[repr(C)]
pub struct ucp_config {
    _private: [u8; 0],
}
/// Opaque `struct ucp_worker`.
#[repr(C)]
pub struct ucp_worker {
    _private: [u8; 0],
}
/// Opaque `struct ucp_ep`.
#[repr(C)]
pub struct ucp_ep {
    _private: [u8; 0],
}
/// Opaque `struct ucp_address`.
#[repr(C)]
pub struct ucp_address {
    _private: [u8; 0],
}
/// Opaque `struct ucp_mem`.
#[repr(C)]
pub struct ucp_mem {
    _private: [u8; 0],
}
/// Opaque `struct ucp_rkey`.
#[repr(C)]
pub struct ucp_rkey {
    _private: [u8; 0],
}

/// `ucp_context_h`.
pub type ucp_context_h = *mut ucp_context;
/// `ucp_worker_h`.
pub type ucp_worker_h = *mut ucp_worker;
/// `ucp_ep_h`.
pub type ucp_ep_h = *mut ucp_ep;
/// `ucp_mem_h`.
pub type ucp_mem_h = *mut ucp_mem;
/// `ucp_rkey_h`.
pub type ucp_rkey_h = *mut ucp_rkey;

// --- ucs_status_t values (ucs/type/status.h) ---
/// `UCS_OK`.
pub const UCS_OK: ucs_status_t = 0;
/// `UCS_INPROGRESS`.
pub const UCS_INPROGRESS: ucs_status_t = 1;
/// `UCS_ERR_UNREACHABLE`: e.g. `ucp_rkey_ptr` for a key no shared-memory transport maps.
pub const UCS_ERR_UNREACHABLE: ucs_status_t = -6;
/// `UCS_ERR_NO_DEVICE`: e.g. `ucp_worker_create` when a network interface the context
/// listed has no active address any more.
pub const UCS_ERR_NO_DEVICE: ucs_status_t = -14;
/// `UCS_ERR_BUSY`: `ucp_worker_arm` when events are pending (progress before waiting).
pub const UCS_ERR_BUSY: ucs_status_t = -15;
/// `UCS_ERR_CANCELED`.
pub const UCS_ERR_CANCELED: ucs_status_t = -16;
/// `UCS_ERR_LAST`: the most negative status; pointers in `[UCS_ERR_LAST, -1]` are errors.
pub const UCS_ERR_LAST: ucs_status_t = -100;

// --- ucp_params_t (ucp.h, `enum ucp_params_field` / `enum ucp_feature`) ---
/// `UCP_PARAM_FIELD_FEATURES`.
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
/// `UCP_PARAM_FIELD_MT_WORKERS_SHARED`.
pub const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
/// `UCP_PARAM_FIELD_ESTIMATED_NUM_EPS`.
pub const UCP_PARAM_FIELD_ESTIMATED_NUM_EPS: u64 = 1 << 6;
/// `UCP_FEATURE_RMA`.
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
/// `UCP_FEATURE_WAKEUP`: a worker event fd to block on instead of polling.
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
/// `UCP_FEATURE_AM`.
pub const UCP_FEATURE_AM: u64 = 1 << 6;

// --- ucp_worker_params_t ---
/// `UCP_WORKER_PARAM_FIELD_THREAD_MODE`.
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `UCS_THREAD_MODE_SINGLE`.
pub const UCS_THREAD_MODE_SINGLE: ucs_thread_mode_t = 0;

// --- ucp_ep_params_t ---
/// `UCP_EP_PARAM_FIELD_REMOTE_ADDRESS`.
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
/// `UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE`.
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
/// `UCP_EP_PARAM_FIELD_ERR_HANDLER`.
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
/// `UCP_ERR_HANDLING_MODE_PEER`.
pub const UCP_ERR_HANDLING_MODE_PEER: ucp_err_handling_mode_t = 1;
/// `UCP_EP_CLOSE_FLAG_FORCE`.
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

// --- ucp_mem_map_params_t ---
/// `UCP_MEM_MAP_PARAM_FIELD_ADDRESS`.
pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
/// `UCP_MEM_MAP_PARAM_FIELD_LENGTH`.
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
/// `UCP_MEM_MAP_PARAM_FIELD_FLAGS`.
pub const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
/// `UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE`.
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
/// `UCP_MEM_MAP_ALLOCATE`.
pub const UCP_MEM_MAP_ALLOCATE: c_uint = 1 << 1;
/// `UCP_MEM_ATTR_FIELD_ADDRESS`.
pub const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
/// `UCP_MEM_ATTR_FIELD_LENGTH`.
pub const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;
/// `UCS_MEMORY_TYPE_HOST`.
pub const UCS_MEMORY_TYPE_HOST: ucs_memory_type_t = 0;
/// `UCS_MEMORY_TYPE_CUDA`.
pub const UCS_MEMORY_TYPE_CUDA: ucs_memory_type_t = 1;

// --- ucp_request_param_t (`ucp_op_attr_t`) ---
/// `UCP_OP_ATTR_FIELD_FLAGS`.
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
/// `UCP_OP_ATTR_FIELD_MEMORY_TYPE`.
pub const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;
/// `UCP_OP_ATTR_FIELD_MEMH` (since 1.13: the local buffer's registration, skips a lookup).
pub const UCP_OP_ATTR_FIELD_MEMH: u32 = 1 << 8;

/// `ucp_err_handler_cb_t`: `(arg, ep, status)`; `status` is the one-byte `ucs_status_t`.
pub type ucp_err_handler_cb_t = unsafe extern "C" fn(*mut c_void, ucp_ep_h, ucs_status_t);
/// `ucp_send_nbx_callback_t` (unused: completion is polled; kept for the union's type).
pub type ucp_send_nbx_callback_t = unsafe extern "C" fn(*mut c_void, ucs_status_t, *mut c_void);

/// `ucp_params_t` (1.13 layout, 80 bytes).
#[repr(C)]
pub struct ucp_params_t {
    /// Which fields below are set.
    pub field_mask: u64,
    /// `UCP_FEATURE_*` bits.
    pub features: u64,
    /// `request_size`.
    pub request_size: usize,
    /// `request_init` callback.
    pub request_init: Option<unsafe extern "C" fn(*mut c_void)>,
    /// `request_cleanup` callback.
    pub request_cleanup: Option<unsafe extern "C" fn(*mut c_void)>,
    /// `tag_sender_mask`.
    pub tag_sender_mask: u64,
    /// `mt_workers_shared`.
    pub mt_workers_shared: c_int,
    /// `estimated_num_eps`.
    pub estimated_num_eps: usize,
    /// `estimated_num_ppn`.
    pub estimated_num_ppn: usize,
    /// `name`.
    pub name: *const c_char,
}

/// `ucs_cpu_set_t`: 1024 bits.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ucs_cpu_set_t {
    /// `ucs_bits`.
    pub ucs_bits: [u64; 16],
}

/// `ucp_worker_params_t` (1.13 layout, 200 bytes).
#[repr(C)]
pub struct ucp_worker_params_t {
    /// Which fields below are set.
    pub field_mask: u64,
    /// `thread_mode`.
    pub thread_mode: ucs_thread_mode_t,
    /// `cpu_mask`.
    pub cpu_mask: ucs_cpu_set_t,
    /// `events`.
    pub events: c_uint,
    /// `user_data`.
    pub user_data: *mut c_void,
    /// `event_fd`.
    pub event_fd: c_int,
    /// `flags`.
    pub flags: u64,
    /// `name`.
    pub name: *const c_char,
    /// `am_alignment`.
    pub am_alignment: usize,
    /// `client_id`.
    pub client_id: u64,
}

/// `ucp_err_handler_t`.
#[repr(C)]
pub struct ucp_err_handler_t {
    /// Called from `ucp_worker_progress` when the endpoint fails.
    pub cb: Option<ucp_err_handler_cb_t>,
    /// Passed back as the callback's first argument.
    pub arg: *mut c_void,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub struct ucs_sock_addr_t {
    /// `const struct sockaddr *addr`.
    pub addr: *const c_void,
    /// `socklen_t addrlen`.
    pub addrlen: u32,
}

/// `ucp_ep_params_t` (1.13 layout, 104 bytes).
#[repr(C)]
pub struct ucp_ep_params_t {
    /// Which fields below are set.
    pub field_mask: u64,
    /// Remote worker address.
    pub address: *const ucp_address,
    /// Error handling mode.
    pub err_mode: ucp_err_handling_mode_t,
    /// Error handler.
    pub err_handler: ucp_err_handler_t,
    /// `user_data`.
    pub user_data: *mut c_void,
    /// `flags`.
    pub flags: c_uint,
    /// `sockaddr`.
    pub sockaddr: ucs_sock_addr_t,
    /// `conn_request`.
    pub conn_request: *mut c_void,
    /// `name`.
    pub name: *const c_char,
    /// `local_sockaddr`.
    pub local_sockaddr: ucs_sock_addr_t,
}

/// `ucp_mem_map_params_t` (1.13 layout, 40 bytes).
#[repr(C)]
pub struct ucp_mem_map_params_t {
    /// Which fields below are set.
    pub field_mask: u64,
    /// Start of the memory to register (NULL with `UCP_MEM_MAP_ALLOCATE`).
    pub address: *mut c_void,
    /// Length in bytes.
    pub length: usize,
    /// `UCP_MEM_MAP_*` flags.
    pub flags: c_uint,
    /// `UCP_MEM_MAP_PROT_*` bits.
    pub prot: c_uint,
    /// Memory type.
    pub memory_type: ucs_memory_type_t,
}

/// `ucp_mem_attr_t` (32 bytes).
#[repr(C)]
pub struct ucp_mem_attr_t {
    /// Which fields below to fill.
    pub field_mask: u64,
    /// Start of the mapped memory.
    pub address: *mut c_void,
    /// Length of the mapped memory.
    pub length: usize,
    /// Memory type.
    pub mem_type: ucs_memory_type_t,
}

/// `ucp_request_param_t` (1.13 layout, 72 bytes; 1.22 appends fields behind new bits).
#[repr(C)]
pub struct ucp_request_param_t {
    /// `UCP_OP_ATTR_*` bits saying which fields are set.
    pub op_attr_mask: u32,
    /// Operation flags (e.g. `UCP_EP_CLOSE_FLAG_FORCE` for `ucp_ep_close_nbx`).
    pub flags: u32,
    /// User-provided request storage.
    pub request: *mut c_void,
    /// Completion callback (a union in C; only the send variant is named here).
    pub cb: Option<ucp_send_nbx_callback_t>,
    /// Datatype.
    pub datatype: ucp_datatype_t,
    /// Callback argument.
    pub user_data: *mut c_void,
    /// Reply buffer (atomics).
    pub reply_buffer: *mut c_void,
    /// Memory type of the local buffer.
    pub memory_type: ucs_memory_type_t,
    /// Receive info (a union of pointers in C).
    pub recv_info: *mut c_void,
    /// Registration of the local buffer.
    pub memh: ucp_mem_h,
}

impl ucp_request_param_t {
    /// A parameter block with no field set: UCX reads nothing but the mask.
    pub fn empty() -> Self {
        Self {
            op_attr_mask: 0,
            flags: 0,
            request: std::ptr::null_mut(),
            cb: None,
            datatype: 0,
            user_data: std::ptr::null_mut(),
            reply_buffer: std::ptr::null_mut(),
            memory_type: 0,
            recv_info: std::ptr::null_mut(),
            memh: std::ptr::null_mut(),
        }
    }
}

// Sizes measured with gcc against the UCX 1.13 headers (x86_64 / aarch64 LP64).
const _: () = assert!(std::mem::size_of::<ucp_params_t>() == 80);
const _: () = assert!(std::mem::size_of::<ucp_worker_params_t>() == 200);
const _: () = assert!(std::mem::size_of::<ucp_ep_params_t>() == 104);
const _: () = assert!(std::mem::size_of::<ucp_mem_map_params_t>() == 40);
const _: () = assert!(std::mem::size_of::<ucp_mem_attr_t>() == 32);
const _: () = assert!(std::mem::size_of::<ucp_request_param_t>() == 72);
const _: () = assert!(std::mem::offset_of!(ucp_worker_params_t, events) == 144);
const _: () = assert!(std::mem::offset_of!(ucp_ep_params_t, err_handler) == 24);
const _: () = assert!(std::mem::offset_of!(ucp_ep_params_t, sockaddr) == 56);
const _: () = assert!(std::mem::offset_of!(ucp_request_param_t, memh) == 64);

/// `UCS_PTR_IS_ERR`: pointer values in `[UCS_ERR_LAST, -1]` (as a signed integer) carry an
/// error status instead of a request.
pub fn ptr_is_err(ptr: ucs_status_ptr_t) -> bool {
    let value = ptr as isize;
    (isize::from(UCS_ERR_LAST)..=-1).contains(&value)
}

/// `UCS_PTR_RAW_STATUS` for a pointer that [`ptr_is_err`] accepted.
pub fn ptr_status(ptr: ucs_status_ptr_t) -> ucs_status_t {
    // Range-checked by the caller through `ptr_is_err`; -100..=-1 fits an i8.
    i8::try_from(ptr as isize).unwrap_or(UCS_ERR_LAST)
}

/// The functions resolved from libucp (and `ucs_status_string` from libucs).
///
/// Field names are the C names. The table keeps the libraries loaded, so its function
/// pointers stay valid for as long as it lives (forever, for the one cached by [`api`]).
#[allow(missing_docs)]
pub struct Api {
    pub ucp_get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint),
    pub ucp_config_read:
        unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut ucp_config) -> ucs_status_t,
    pub ucp_config_modify:
        unsafe extern "C" fn(*mut ucp_config, *const c_char, *const c_char) -> ucs_status_t,
    pub ucp_config_release: unsafe extern "C" fn(*mut ucp_config),
    pub ucp_init_version: unsafe extern "C" fn(
        c_uint,
        c_uint,
        *const ucp_params_t,
        *const ucp_config,
        *mut ucp_context_h,
    ) -> ucs_status_t,
    pub ucp_cleanup: unsafe extern "C" fn(ucp_context_h),
    pub ucp_worker_create: unsafe extern "C" fn(
        ucp_context_h,
        *const ucp_worker_params_t,
        *mut ucp_worker_h,
    ) -> ucs_status_t,
    pub ucp_worker_destroy: unsafe extern "C" fn(ucp_worker_h),
    pub ucp_worker_get_address:
        unsafe extern "C" fn(ucp_worker_h, *mut *mut ucp_address, *mut usize) -> ucs_status_t,
    pub ucp_worker_release_address: unsafe extern "C" fn(ucp_worker_h, *mut ucp_address),
    pub ucp_worker_progress: unsafe extern "C" fn(ucp_worker_h) -> c_uint,
    pub ucp_worker_get_efd: unsafe extern "C" fn(ucp_worker_h, *mut c_int) -> ucs_status_t,
    pub ucp_worker_arm: unsafe extern "C" fn(ucp_worker_h) -> ucs_status_t,
    pub ucp_worker_flush_nbx:
        unsafe extern "C" fn(ucp_worker_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub ucp_ep_create:
        unsafe extern "C" fn(ucp_worker_h, *const ucp_ep_params_t, *mut ucp_ep_h) -> ucs_status_t,
    pub ucp_ep_close_nbx:
        unsafe extern "C" fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub ucp_ep_flush_nbx:
        unsafe extern "C" fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub ucp_mem_map: unsafe extern "C" fn(
        ucp_context_h,
        *const ucp_mem_map_params_t,
        *mut ucp_mem_h,
    ) -> ucs_status_t,
    pub ucp_mem_unmap: unsafe extern "C" fn(ucp_context_h, ucp_mem_h) -> ucs_status_t,
    pub ucp_mem_query: unsafe extern "C" fn(ucp_mem_h, *mut ucp_mem_attr_t) -> ucs_status_t,
    pub ucp_rkey_pack: unsafe extern "C" fn(
        ucp_context_h,
        ucp_mem_h,
        *mut *mut c_void,
        *mut usize,
    ) -> ucs_status_t,
    pub ucp_rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub ucp_ep_rkey_unpack:
        unsafe extern "C" fn(ucp_ep_h, *const c_void, *mut ucp_rkey_h) -> ucs_status_t,
    pub ucp_rkey_destroy: unsafe extern "C" fn(ucp_rkey_h),
    pub ucp_rkey_ptr: unsafe extern "C" fn(ucp_rkey_h, u64, *mut *mut c_void) -> ucs_status_t,
    pub ucp_put_nbx: unsafe extern "C" fn(
        ucp_ep_h,
        *const c_void,
        usize,
        u64,
        ucp_rkey_h,
        *const ucp_request_param_t,
    ) -> ucs_status_ptr_t,
    pub ucp_get_nbx: unsafe extern "C" fn(
        ucp_ep_h,
        *mut c_void,
        usize,
        u64,
        ucp_rkey_h,
        *const ucp_request_param_t,
    ) -> ucs_status_ptr_t,
    pub ucp_request_check_status: unsafe extern "C" fn(*mut c_void) -> ucs_status_t,
    pub ucp_request_free: unsafe extern "C" fn(*mut c_void),
    pub ucs_status_string: unsafe extern "C" fn(ucs_status_t) -> *const c_char,
    /// The library version, `(major, minor, release)`, read at load.
    pub version: (u32, u32, u32),
    /// Where libucp was loaded from (a path, or the soname given to the system loader).
    pub loaded_from: String,
    _libs: Vec<libloading::Library>,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api")
            .field("version", &self.version)
            .field("loaded_from", &self.loaded_from)
            .finish_non_exhaustive()
    }
}

impl Api {
    /// The text UCX gives for a status code.
    pub fn status_string(&self, status: ucs_status_t) -> String {
        // SAFETY: `ucs_status_string` accepts any status value and returns a pointer to a
        // static NUL-terminated string (or "Unknown error" text); we copy it at once.
        let text = unsafe { (self.ucs_status_string)(status) };
        if text.is_null() {
            return format!("unknown UCX status {status}");
        }
        // SAFETY: non-null, NUL-terminated, static storage (see above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }

    /// Builds [`UcxError::Status`] for `op` from a failed status.
    pub fn error(&self, op: &'static str, status: ucs_status_t) -> UcxError {
        UcxError::Status {
            op,
            code: i32::from(status),
            message: self.status_string(status),
        }
    }

    /// `Ok(())` for `UCS_OK`, else [`UcxError::Status`] for `op`.
    pub fn check(&self, op: &'static str, status: ucs_status_t) -> Result<(), UcxError> {
        if status == UCS_OK {
            Ok(())
        } else {
            Err(self.error(op, status))
        }
    }
}

/// The oldest UCX this binding accepts, `(major, minor)`: `ucp_ep_close_nbx`,
/// `ucp_ep_flush_nbx` and the `*_nbx` RMA calls with a 72-byte `ucp_request_param_t` are
/// all present from 1.12 on (1.10 and 1.11 lack some, and have a shorter parameter block).
pub const VERSION_MIN: (u32, u32) = (1, 12);

/// The UCP API version we pass to `ucp_init_version` (the headers' `UCP_API_MAJOR/MINOR`
/// for the layouts in this file). An older 1.12 library gets its own minor.
pub const API_VERSION: (u32, u32) = (1, 13);

/// The environment variable naming libucp (a file) or the directory holding it.
pub const LIB_ENV: &str = "HANDOFF_UCX_LIB";

/// Sonames tried through the system loader when [`LIB_ENV`] is unset.
const SYSTEM_SONAMES: [&str; 2] = ["libucp.so.0", "libucp.so"];

/// libucp's own dependencies, loaded from a named directory before libucp itself so the
/// system loader (which matches already-loaded objects by soname) cannot pair this libucp
/// with another version's libucs/libuct found on the default path. Dependency order.
const SIBLING_SONAMES: [&str; 3] = ["libucm.so.0", "libucs.so.0", "libuct.so.0"];

static API: OnceLock<Result<Api, UcxError>> = OnceLock::new();

/// The process-wide function table: loaded on first use from [`LIB_ENV`] or the system
/// loader, then cached (success or failure) for the life of the process.
pub fn api() -> Result<&'static Api, UcxError> {
    API.get_or_init(|| load_from(std::env::var_os(LIB_ENV).map(PathBuf::from).as_deref()))
        .as_ref()
        .map_err(Clone::clone)
}

/// Loads libucp without caching: from `path` (a library file, or a directory holding
/// `libucp.so.0`/`libucp.so`) when given, else through the system loader.
pub fn load_from(path: Option<&Path>) -> Result<Api, UcxError> {
    let mut libs = Vec::new();
    let (ucp, loaded_from, ucs) = match path {
        Some(path) => load_path(path, &mut libs)?,
        None => load_system()?,
    };
    let ucs = match ucs {
        Some(lib) => lib,
        // Already loaded as libucp's dependency: dlopen by soname returns that same object.
        // SAFETY: libucs has no initialisers beyond UCX's own constructors, already run.
        None => unsafe { libloading::Library::new("libucs.so.0") }.map_err(|e| {
            UcxError::LibraryNotFound {
                tried: vec!["libucs.so.0".into()],
                detail: e.to_string(),
            }
        })?,
    };
    let api = resolve(&ucp, &ucs, loaded_from)?;
    libs.push(ucp);
    libs.push(ucs);
    let mut api = Api { _libs: libs, ..api };
    api.version = check_version(&api)?;
    Ok(api)
}

fn load_path(
    path: &Path,
    libs: &mut Vec<libloading::Library>,
) -> Result<(libloading::Library, String, Option<libloading::Library>), UcxError> {
    let (dir, candidates) = if path.is_dir() {
        let candidates = SYSTEM_SONAMES.iter().map(|n| path.join(n)).collect();
        (Some(path.to_path_buf()), candidates)
    } else {
        (
            path.parent().map(Path::to_path_buf),
            vec![path.to_path_buf()],
        )
    };
    let tried: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
    let Some(file) = candidates.iter().find(|p| p.is_file()) else {
        return Err(UcxError::LibraryNotFound {
            tried,
            detail: "no such file".into(),
        });
    };
    let mut ucs = None;
    if let Some(dir) = dir {
        for soname in SIBLING_SONAMES {
            let sibling = dir.join(soname);
            if !sibling.is_file() {
                continue;
            }
            // SAFETY: loading a UCX library runs UCX's constructors, which only set up
            // UCX-internal state; nothing of ours runs.
            let lib = unsafe { libloading::Library::new(&sibling) }.map_err(|e| {
                UcxError::LibraryNotFound {
                    tried: vec![sibling.display().to_string()],
                    detail: e.to_string(),
                }
            })?;
            if soname == "libucs.so.0" {
                ucs = Some(lib);
            } else {
                libs.push(lib);
            }
        }
    }
    // SAFETY: as above, libucp's constructors only initialise UCX.
    let ucp = unsafe { libloading::Library::new(file) }.map_err(|e| UcxError::LibraryNotFound {
        tried: tried.clone(),
        detail: e.to_string(),
    })?;
    Ok((ucp, file.display().to_string(), ucs))
}

fn load_system() -> Result<(libloading::Library, String, Option<libloading::Library>), UcxError> {
    let mut details = Vec::new();
    for soname in SYSTEM_SONAMES {
        // SAFETY: libucp's constructors only initialise UCX-internal state.
        match unsafe { libloading::Library::new(soname) } {
            Ok(lib) => return Ok((lib, soname.to_string(), None)),
            Err(e) => details.push(e.to_string()),
        }
    }
    Err(UcxError::LibraryNotFound {
        tried: SYSTEM_SONAMES.iter().map(|s| (*s).to_string()).collect(),
        detail: details.join("; "),
    })
}

/// Copies one function pointer out of `lib`.
///
/// # Safety
/// `T` must be the exact `extern "C"` signature of the C function `name`.
unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &'static str) -> Result<T, UcxError> {
    // SAFETY: the caller guarantees the signature; the pointer is used only while the
    // `Library` lives (the `Api` owns it).
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| UcxError::SymbolMissing { name })
}

fn resolve(
    ucp: &libloading::Library,
    ucs: &libloading::Library,
    loaded_from: String,
) -> Result<Api, UcxError> {
    // SAFETY: each type below is transcribed from the UCX 1.13 prototype of the same name
    // (ucp/api/ucp.h, ucs/type/status.h), with `ucs_status_t` as its real one-byte width.
    unsafe {
        Ok(Api {
            ucp_get_version: sym(ucp, "ucp_get_version")?,
            ucp_config_read: sym(ucp, "ucp_config_read")?,
            ucp_config_modify: sym(ucp, "ucp_config_modify")?,
            ucp_config_release: sym(ucp, "ucp_config_release")?,
            ucp_init_version: sym(ucp, "ucp_init_version")?,
            ucp_cleanup: sym(ucp, "ucp_cleanup")?,
            ucp_worker_create: sym(ucp, "ucp_worker_create")?,
            ucp_worker_destroy: sym(ucp, "ucp_worker_destroy")?,
            ucp_worker_get_address: sym(ucp, "ucp_worker_get_address")?,
            ucp_worker_release_address: sym(ucp, "ucp_worker_release_address")?,
            ucp_worker_progress: sym(ucp, "ucp_worker_progress")?,
            ucp_worker_get_efd: sym(ucp, "ucp_worker_get_efd")?,
            ucp_worker_arm: sym(ucp, "ucp_worker_arm")?,
            ucp_worker_flush_nbx: sym(ucp, "ucp_worker_flush_nbx")?,
            ucp_ep_create: sym(ucp, "ucp_ep_create")?,
            ucp_ep_close_nbx: sym(ucp, "ucp_ep_close_nbx")?,
            ucp_ep_flush_nbx: sym(ucp, "ucp_ep_flush_nbx")?,
            ucp_mem_map: sym(ucp, "ucp_mem_map")?,
            ucp_mem_unmap: sym(ucp, "ucp_mem_unmap")?,
            ucp_mem_query: sym(ucp, "ucp_mem_query")?,
            ucp_rkey_pack: sym(ucp, "ucp_rkey_pack")?,
            ucp_rkey_buffer_release: sym(ucp, "ucp_rkey_buffer_release")?,
            ucp_ep_rkey_unpack: sym(ucp, "ucp_ep_rkey_unpack")?,
            ucp_rkey_destroy: sym(ucp, "ucp_rkey_destroy")?,
            ucp_rkey_ptr: sym(ucp, "ucp_rkey_ptr")?,
            ucp_put_nbx: sym(ucp, "ucp_put_nbx")?,
            ucp_get_nbx: sym(ucp, "ucp_get_nbx")?,
            ucp_request_check_status: sym(ucp, "ucp_request_check_status")?,
            ucp_request_free: sym(ucp, "ucp_request_free")?,
            ucs_status_string: sym(ucs, "ucs_status_string")?,
            version: (0, 0, 0),
            loaded_from,
            _libs: Vec::new(),
        })
    }
}

fn check_version(api: &Api) -> Result<(u32, u32, u32), UcxError> {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: `ucp_get_version` writes three `unsigned` through valid pointers.
    unsafe { (api.ucp_get_version)(&mut major, &mut minor, &mut release) };
    let found = format!("{major}.{minor}.{release}");
    if (major, minor) < VERSION_MIN {
        return Err(UcxError::VersionTooOld {
            found,
            min: format!("{}.{}", VERSION_MIN.0, VERSION_MIN.1),
        });
    }
    if major != 1 {
        return Err(UcxError::VersionUnsupported { found });
    }
    Ok((major, minor, release))
}
