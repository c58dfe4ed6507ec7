//! Finding the CUDA driver and its devices at run time, without ever panicking.
//!
//! cudarc loads `libcuda` lazily and panics when it cannot. So every entry point here
//! first asks cudarc whether the library can be loaded at all
//! ([`cudarc::driver::sys::is_culib_present`]), and every call into cudarc runs under
//! `guarded`, which turns both driver error codes and panics into [`GpuError`] values.

use std::ffi::c_int;
use std::panic::{self, AssertUnwindSafe};

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;

use crate::GpuError;

/// The environment variable that, set to `1`, makes every probe answer
/// [`GpuError::NoDriver`] as if `libcuda` were absent: it lets the host fallback be
/// tested (and forced) on machines that do have a GPU.
pub const CUDA_DISABLE_ENV: &str = "HANDOFF_CUDA_DISABLE";

/// The most devices we accept from the driver. Real nodes have 8 or 16 GPUs; a larger
/// count means a confused driver, and the bound keeps the per-device list small.
pub const DEVICE_COUNT_MAX: u32 = 256;

/// What [`probe`] found: the driver and every visible device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// The CUDA version the driver supports.
    pub driver_version: DriverVersion,
    /// Every visible device, in ordinal order; never empty.
    pub devices: Vec<DeviceInfo>,
}

/// A CUDA driver version, as `cuDriverGetVersion` encodes it (`1000 * major + 10 * minor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverVersion {
    /// Major version, e.g. 12.
    pub major: u32,
    /// Minor version, e.g. 8.
    pub minor: u32,
}

impl DriverVersion {
    /// Decodes the driver's integer (`12080` is 12.8). Negative values, which no driver
    /// returns, decode as 0.0 rather than wrapping.
    pub fn from_raw(raw: i32) -> Self {
        let raw = u32::try_from(raw).unwrap_or(0);
        Self {
            major: raw / 1000,
            minor: (raw % 1000) / 10,
        }
    }
}

impl std::fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// One CUDA device, as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device ordinal (what `CUDA_VISIBLE_DEVICES` renumbers).
    pub ordinal: u32,
    /// The marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Total device memory.
    pub total_memory_bytes: u64,
    /// Compute capability (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (u32, u32),
}

/// Finds the CUDA driver and describes every visible device.
///
/// Called once at start-up by whatever chooses between host and CUDA memory, and by
/// GPU tests to decide whether to skip. Creates no CUDA context, so it allocates nothing
/// on the devices.
///
/// # Errors
/// [`GpuError::NoDriver`] without `libcuda` (or with [`CUDA_DISABLE_ENV`] set),
/// [`GpuError::NoDevice`] when the driver sees no device, [`GpuError::Driver`] or
/// [`GpuError::DriverPanicked`] when a driver call fails.
pub fn probe() -> Result<GpuInfo, GpuError> {
    init_driver()?;
    let raw_version = guarded("cuDriverGetVersion", driver_version_raw)?;
    let count = device_count()?;
    let devices = (0..count).map(device_info).collect::<Result<Vec<_>, _>>()?;
    Ok(GpuInfo {
        driver_version: DriverVersion::from_raw(raw_version),
        devices,
    })
}

/// Whether [`CUDA_DISABLE_ENV`] asks us to pretend there is no driver: any value but
/// empty or `0` counts, so `=1`, `=true` and `=yes` all work.
pub fn cuda_disabled_by_env() -> bool {
    std::env::var_os(CUDA_DISABLE_ENV).is_some_and(|value| !value.is_empty() && value != "0")
}

/// Makes sure the driver is loaded and initialised. Idempotent: `cuInit` may be called
/// any number of times.
pub(crate) fn init_driver() -> Result<(), GpuError> {
    if cuda_disabled_by_env() {
        return Err(GpuError::NoDriver {
            reason: format!("{CUDA_DISABLE_ENV} is set"),
        });
    }
    if !driver_library_present() {
        return Err(GpuError::NoDriver {
            reason: "libcuda could not be loaded (no NVIDIA driver on this machine)".into(),
        });
    }
    match guarded("cuInit", cu::init) {
        Err(GpuError::Driver { code, .. })
            if code == sys::CUresult::CUDA_ERROR_NO_DEVICE as u32 =>
        {
            Err(GpuError::NoDevice)
        }
        other => other,
    }
}

/// Whether `libcuda` can be loaded. This must run before any other cudarc driver call,
/// because those panic when the library is missing.
fn driver_library_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the driver library names; loading
    // the system's NVIDIA driver library runs its initialisers, which is exactly what
    // any CUDA program does. A panic inside is caught and counts as "not present".
    panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// The number of visible devices, checked against [`DEVICE_COUNT_MAX`];
/// zero is [`GpuError::NoDevice`]. The driver must be initialised.
pub(crate) fn device_count() -> Result<u32, GpuError> {
    let count = guarded("cuDeviceGetCount", cu::device::get_count)?;
    if count <= 0 {
        return Err(GpuError::NoDevice);
    }
    match u32::try_from(count) {
        Ok(count) if count <= DEVICE_COUNT_MAX => Ok(count),
        _ => Err(GpuError::TooManyDevices {
            count: i64::from(count),
            max: DEVICE_COUNT_MAX,
        }),
    }
}

fn driver_version_raw() -> Result<i32, DriverError> {
    let mut version: c_int = 0;
    // SAFETY: `cuDriverGetVersion` writes one `int` through a pointer to a live local.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
    Ok(version)
}

fn device_info(ordinal: u32) -> Result<DeviceInfo, GpuError> {
    // An ordinal below DEVICE_COUNT_MAX always fits in a C int.
    let ordinal_c = c_int::try_from(ordinal).map_err(|_| GpuError::Overflow {
        what: "device ordinal",
    })?;
    let device = guarded("cuDeviceGet", || cu::device::get(ordinal_c))?;
    let name = guarded("cuDeviceGetName", || cu::device::get_name(device))?;
    // SAFETY: `device` came from `cuDeviceGet` just above.
    let total = guarded("cuDeviceTotalMem", || unsafe {
        cu::device::total_mem(device)
    })?;
    let major = attribute(
        device,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
    )?;
    let minor = attribute(
        device,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    )?;
    Ok(DeviceInfo {
        ordinal,
        name,
        total_memory_bytes: u64::try_from(total).map_err(|_| GpuError::Overflow {
            what: "device memory size",
        })?,
        compute_capability: (major, minor),
    })
}

fn attribute(device: sys::CUdevice, attribute: sys::CUdevice_attribute) -> Result<u32, GpuError> {
    // SAFETY: `device` came from `cuDeviceGet`; the attribute is a valid enum value.
    let value = guarded("cuDeviceGetAttribute", || unsafe {
        cu::device::get_attribute(device, attribute)
    })?;
    // Compute capabilities are small non-negative numbers; a negative one is nonsense.
    Ok(u32::try_from(value).unwrap_or(0))
}

/// Runs one call into cudarc, turning its error code into [`GpuError::Driver`] and a
/// panic inside it into [`GpuError::DriverPanicked`].
///
/// `call` names the driver call for the error message. This relies on unwinding; a
/// binary built with `panic = "abort"` loses the second guard (the first, the library
/// check in [`init_driver`], still holds).
pub(crate) fn guarded<T>(
    call: &'static str,
    f: impl FnOnce() -> Result<T, DriverError>,
) -> Result<T, GpuError> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(driver_error(call, error)),
        Err(payload) => Err(GpuError::DriverPanicked {
            call,
            message: panic_message(payload.as_ref()),
        }),
    }
}

/// Names a driver error without calling back into the driver (`cuGetErrorString`
/// could itself be the missing symbol).
fn driver_error(call: &'static str, error: DriverError) -> GpuError {
    GpuError::Driver {
        call,
        code: error.0 as u32,
        name: format!("{:?}", error.0),
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_owned()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_version_decodes_the_drivers_integer() {
        assert_eq!(
            DriverVersion::from_raw(12080),
            DriverVersion {
                major: 12,
                minor: 8
            }
        );
        assert_eq!(DriverVersion::from_raw(12020).to_string(), "12.2");
        assert_eq!(DriverVersion::from_raw(11040).to_string(), "11.4");
        assert_eq!(
            DriverVersion::from_raw(-5),
            DriverVersion { major: 0, minor: 0 }
        );
    }

    #[test]
    fn guarded_turns_a_panic_into_an_error() {
        let result: Result<(), GpuError> = guarded("cuTest", || panic!("Missing symbol cuTest"));
        assert_eq!(
            result,
            Err(GpuError::DriverPanicked {
                call: "cuTest",
                message: "Missing symbol cuTest".into()
            })
        );
    }

    #[test]
    fn guarded_names_the_driver_error_code() {
        let result: Result<(), GpuError> = guarded("cuMemAlloc", || {
            Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))
        });
        assert_eq!(
            result,
            Err(GpuError::Driver {
                call: "cuMemAlloc",
                code: 2,
                name: "CUDA_ERROR_OUT_OF_MEMORY".into()
            })
        );
    }

    #[test]
    fn probe_never_panics_and_names_a_missing_driver() {
        match probe() {
            Ok(info) => assert!(!info.devices.is_empty()),
            Err(GpuError::NoDriver { reason }) => assert!(!reason.is_empty()),
            Err(other) => eprintln!("probe error (not a panic): {other}"),
        }
    }
}
