//! [`Context`]: one UCP context (`ucp_init_version` ... `ucp_cleanup`).

use std::ffi::CString;
use std::rc::Rc;
use std::time::Duration;

use super::sys::{self, Api};
use super::UcxError;

/// The version of the loaded libucp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// Major version (1).
    pub major: u32,
    /// Minor version (12 or newer).
    pub minor: u32,
    /// Release number.
    pub release: u32,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.release)
    }
}

/// UCX keepalive interval set by default. UCX's own default (20 s) is longer than a
/// transfer deadline; the runtime's heartbeats remain the main liveness signal, and this
/// only has to catch a peer death that a transport cannot see by itself (shared memory)
/// within one transfer's deadline.
pub const KEEPALIVE_INTERVAL_DEFAULT: Duration = Duration::from_secs(2);

/// How to build a [`Context`]. `UCX_*` environment variables apply first (UCX reads them
/// in `ucp_config_read`), then the fields below, then `config` entries.
#[derive(Debug, Clone)]
pub struct ContextOptions {
    /// Let the shared-memory transports (posix, sysv) serve endpoints created with
    /// peer-failure handling (`MM_ERROR_HANDLING=y`). UCX (1.13 through 1.22) leaves this
    /// off, so every endpoint we create (always `UCP_ERR_HANDLING_MODE_PEER`) would fall
    /// back to TCP between processes on one host: 0.3 GB/s instead of several GB/s. A
    /// dead peer is still seen, through the TCP wireup lane and keepalive. Default: on.
    pub shared_memory_error_handling: bool,
    /// UCX keepalive interval (`KEEPALIVE_INTERVAL`); `None` keeps UCX's default.
    /// Default: [`KEEPALIVE_INTERVAL_DEFAULT`].
    pub keepalive_interval: Option<Duration>,
    /// Further UCX configuration, names without the `UCX_` prefix (e.g. `("TLS", "sm,tcp")`),
    /// applied last so they override the fields above.
    pub config: Vec<(String, String)>,
    /// Expected number of endpoints (`estimated_num_eps`), a sizing hint for UCX.
    pub estimated_endpoints: Option<usize>,
    /// Ask for wakeup support (`UCP_FEATURE_WAKEUP`): the worker gets an event fd that an
    /// idle thread blocks on ([`super::Worker::event_fd`]) instead of polling on a timer.
    /// Default: off.
    pub wakeup: bool,
}

impl Default for ContextOptions {
    fn default() -> Self {
        Self {
            shared_memory_error_handling: true,
            keepalive_interval: Some(KEEPALIVE_INTERVAL_DEFAULT),
            config: Vec::new(),
            estimated_endpoints: None,
            wakeup: false,
        }
    }
}

impl ContextOptions {
    /// Every `(name, value)` passed to `ucp_config_modify`, in order.
    fn settings(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if self.shared_memory_error_handling {
            out.push(("MM_ERROR_HANDLING".to_string(), "y".to_string()));
        }
        if let Some(interval) = self.keepalive_interval {
            out.push((
                "KEEPALIVE_INTERVAL".to_string(),
                format!("{}us", interval.as_micros().max(1)),
            ));
        }
        out.extend(self.config.iter().cloned());
        out
    }
}

/// Shared by the context's workers and memory regions so the context outlives them.
pub(crate) struct ContextInner {
    pub(crate) api: &'static Api,
    pub(crate) handle: sys::ucp_context_h,
    /// Whether `ucp_request_param_t.memh` is understood (UCX 1.13+).
    pub(crate) memh_param: bool,
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // Cleanup unsets UCX's memory-event handlers: not while a vetting fork is made (`maps`).
        let _fork = super::maps::hold();
        // SAFETY: `handle` came from `ucp_init_version`; every worker and region holds an
        // `Rc` to this inner, so none is left when it drops.
        unsafe { (self.api.ucp_cleanup)(self.handle) };
    }
}

/// One UCP context with the RMA feature: the root of workers and memory registrations.
///
/// Made once per process (per thread that drives UCX) with [`Context::new`]; workers and
/// memory regions are created from it and keep it alive. `!Send`: see the module docs.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Rc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("version", &self.version())
            .finish_non_exhaustive()
    }
}

/// Owns a `ucp_config_t` until `ucp_init_version` has read it.
struct Config<'a> {
    api: &'a Api,
    handle: *mut sys::ucp_config,
}

impl Drop for Config<'_> {
    fn drop(&mut self) {
        // SAFETY: `handle` came from `ucp_config_read` and is released once, here.
        unsafe { (self.api.ucp_config_release)(self.handle) };
    }
}

fn c_string(text: &str) -> Result<CString, UcxError> {
    CString::new(text).map_err(|_| UcxError::InvalidArgument {
        what: format!("NUL byte in UCX config string {text:?}"),
    })
}

impl Context {
    /// A context with default options (loads libucp on first use).
    pub fn new() -> Result<Self, UcxError> {
        Self::with_options(&ContextOptions::default())
    }

    /// A context built with `options`.
    pub fn with_options(options: &ContextOptions) -> Result<Self, UcxError> {
        let api = sys::api()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: NULL prefix and file mean "UCX_ environment only"; `raw` is written on OK.
        let status = unsafe { (api.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut raw) };
        api.check("ucp_config_read", status)?;
        let config = Config { api, handle: raw };
        for (name, value) in &options.settings() {
            let (c_name, c_value) = (c_string(name)?, c_string(value)?);
            // SAFETY: valid config handle and NUL-terminated strings that outlive the call.
            let status = unsafe {
                (api.ucp_config_modify)(config.handle, c_name.as_ptr(), c_value.as_ptr())
            };
            api.check("ucp_config_modify", status)?;
        }
        let mut params = sys::ucp_params_t {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED,
            features: sys::UCP_FEATURE_RMA,
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: std::ptr::null(),
        };
        if options.wakeup {
            params.features |= sys::UCP_FEATURE_WAKEUP;
        }
        if let Some(eps) = options.estimated_endpoints {
            params.field_mask |= sys::UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
            params.estimated_num_eps = eps;
        }
        let (major, minor) = (sys::API_VERSION.0, sys::API_VERSION.1.min(api.version.1));
        let mut handle = std::ptr::null_mut();
        // Init sets UCX's memory-event handlers: not while a vetting fork is made (`maps`).
        let fork = super::maps::hold();
        // SAFETY: `params` is a 1.13-layout block with only 1.13 fields flagged; the config
        // handle is live; `handle` is written on OK.
        let status =
            unsafe { (api.ucp_init_version)(major, minor, &params, config.handle, &mut handle) };
        drop(fork);
        api.check("ucp_init_version", status)?;
        let memh_param = (api.version.0, api.version.1) >= (1, 13);
        Ok(Self {
            inner: Rc::new(ContextInner {
                api,
                handle,
                memh_param,
            }),
        })
    }

    /// The loaded library's version.
    pub fn version(&self) -> Version {
        let (major, minor, release) = self.inner.api.version;
        Version {
            major,
            minor,
            release,
        }
    }

    /// Where libucp was loaded from.
    pub fn library(&self) -> &'static str {
        &self.inner.api.loaded_from
    }
}
