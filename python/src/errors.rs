//! Failures as Python exceptions.
//!
//! Every failure has a stable *reason name* (`peer_lost`, `block_out_of_range`, ...): the
//! lifecycle's [`FailureReason::kind`] for failed requests, and the names below for the
//! API's own errors. The pure-Python `handoff._errors` maps each name to an exception class
//! (`PeerLost`, `BlockOutOfRange`, ...), all subclasses of `handoff.HandoffError` carrying
//! `.reason` and `.detail`. The Python objects are made only here, with the GIL held; code
//! running without it returns a [`Failure`].

use handoff_actors::{Error, FailureReason, RegionError};
use handoff_net::NetError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;

/// A failure not yet turned into a Python exception.
#[derive(Debug)]
pub(crate) struct Failure {
    /// The reason name.
    pub(crate) kind: &'static str,
    /// What happened, for people.
    pub(crate) detail: String,
}

pub(crate) type NativeResult<T> = Result<T, Failure>;

impl Failure {
    pub(crate) fn new(kind: &'static str, detail: impl Into<String>) -> Failure {
        Failure {
            kind,
            detail: detail.into(),
        }
    }

    /// A bad argument from Python.
    pub(crate) fn invalid(detail: impl Into<String>) -> Failure {
        Failure::new("invalid_argument", detail)
    }

    /// A request that ended `Failed(reason)`.
    pub(crate) fn from_reason(reason: &FailureReason) -> Failure {
        Failure::new(reason.kind(), reason.to_string())
    }

    /// An error of the engine API.
    pub(crate) fn from_error(e: &Error) -> Failure {
        let kind = match e {
            Error::Config(_) => "invalid_config",
            Error::AlreadyAttached(_) => "start_failed",
            Error::Stopped => "runtime_stopped",
            Error::DuplicateRequest(_) => "duplicate_request",
            Error::TooManyRequests { .. } => "too_many_requests",
            Error::WrongRole(_) => "wrong_role",
            Error::RequestEnded { .. } => "request_ended",
            Error::AlreadyHandedOver(_) => "already_handed_over",
            Error::AuxTooLarge { .. } | Error::DuplicateBlock { .. } => "invalid_argument",
            Error::Region(r) => region_kind(r),
        };
        Failure::new(kind, e.to_string())
    }

    /// An error starting the networked runtime.
    pub(crate) fn from_net(e: &NetError) -> Failure {
        let kind = match e {
            NetError::Bind { .. } => "bind_failed",
            NetError::Register(_) => "register_failed",
            NetError::DataPlane(_) => "data_plane",
            NetError::Exposed(_) => "insecure",
            NetError::NoAdvertisedHost { .. } => "bind_failed",
            NetError::Runtime(inner) => return Failure::from_error(inner),
        };
        Failure::new(kind, e.to_string())
    }

    /// The Python exception (an instance of the class `handoff._errors` maps the reason
    /// name to; a `RuntimeError` if that module cannot be imported).
    pub(crate) fn into_py(self, py: Python<'_>) -> PyErr {
        static FACTORY: GILOnceCell<PyObject> = GILOnceCell::new();
        let factory = FACTORY.get_or_try_init(py, || -> PyResult<PyObject> {
            Ok(py
                .import("handoff._errors")?
                .getattr("_from_native")?
                .unbind())
        });
        let made = factory.and_then(|f| f.call1(py, (self.kind, self.detail.as_str())));
        match made {
            Ok(exc) => PyErr::from_value(exc.into_bound(py)),
            Err(_) => PyRuntimeError::new_err(format!("{}: {}", self.kind, self.detail)),
        }
    }
}

pub(crate) fn region_kind(e: &RegionError) -> &'static str {
    match e {
        RegionError::OutOfRange { .. } => "block_out_of_range",
        _ => "invalid_memory",
    }
}
