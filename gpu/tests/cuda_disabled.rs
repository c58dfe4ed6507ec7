//! `HANDOFF_CUDA_DISABLE=1` forces the no-driver path, on any machine.
//!
//! One test only: it sets a process-wide environment variable, and this file is its own
//! test process, so no other test can observe it.

use handoff_gpu::{probe, DeviceBuffer, GpuError, CUDA_DISABLE_ENV};

#[test]
fn cuda_disable_env_makes_probe_and_allocation_report_no_driver() {
    std::env::set_var(CUDA_DISABLE_ENV, "1");
    assert!(handoff_gpu::cuda_disabled_by_env());
    match probe() {
        Err(GpuError::NoDriver { reason }) => {
            assert!(reason.contains(CUDA_DISABLE_ENV), "{reason}")
        }
        other => panic!("expected NoDriver, got {other:?}"),
    }
    assert!(matches!(
        DeviceBuffer::alloc_zeroed(0, 4096),
        Err(GpuError::NoDriver { .. })
    ));
    assert!(matches!(
        handoff_gpu::bind_device_to_thread(0),
        Err(GpuError::NoDriver { .. })
    ));
    assert!(matches!(
        handoff_gpu::device_allocation(0x7f00_0000_0000),
        Err(GpuError::NoDriver { .. })
    ));

    std::env::set_var(CUDA_DISABLE_ENV, "0");
    assert!(!handoff_gpu::cuda_disabled_by_env(), "0 means enabled");
    std::env::remove_var(CUDA_DISABLE_ENV);
    assert!(!handoff_gpu::cuda_disabled_by_env());
}
