//! Helpers shared by the workspace-level tests.
#![allow(dead_code)]

use std::ffi::OsString;

/// The `handoff` binary under test: `HANDOFF_BIN` when set (`scripts/gpu-check.sh run`
/// carries a release build to a GPU machine, where the build's own path does not
/// exist), else the one cargo built for the tests.
pub fn handoff_bin() -> OsString {
    std::env::var_os("HANDOFF_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_handoff").into())
}

/// A GPU and a UCX built with CUDA (`HANDOFF_UCX_LIB`), or `None` after saying why not,
/// once per test binary and past the harness's output capture (which only catches the
/// `print!` macros). A probe that fails with a driver present is a failure.
pub fn gpu_with_cuda_ucx() -> Option<()> {
    use handoff_gpu::GpuError;
    let reason = match handoff_gpu::probe() {
        Ok(_) if std::env::var_os("HANDOFF_UCX_LIB").is_some() => return Some(()),
        Ok(_) => "HANDOFF_UCX_LIB is not set: name a libucp built with CUDA".to_string(),
        Err(e @ (GpuError::NoDriver { .. } | GpuError::NoDevice)) => e.to_string(),
        Err(other) => panic!("CUDA probe failed with a driver present: {other}"),
    };
    handoff_testkit::skip_this(handoff_testkit::Need::Gpu, &reason);
    None
}

/// The start of a `handoff worker` command line: the worker's role, engine and bootstrap
/// server; each test adds what it needs.
pub fn worker_args<'a>(role: &'a str, engine: &'a str, boot: &'a str) -> Vec<&'a str> {
    vec![
        "worker",
        "--role",
        role,
        "--engine",
        engine,
        "--bootstrap",
        boot,
    ]
}
