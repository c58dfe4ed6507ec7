//! The UCX data plane under the network transport: one-sided puts and gets into
//! UCX-allocated memory (shared memory between processes on one host, RDMA across hosts).
//!
//! A one-sided operation cannot be refused by the side whose memory it touches, so the
//! grant table here is bookkeeping only; what keeps late operations out of reused blocks is
//! the fence in the lifecycle machines (`one_sided()` is true: decode holds a failed push
//! request's blocks until prefill says `AbortAck`, prefill holds a failed pull request's
//! blocks until decode does), the bounds check of every block against the peer's region
//! descriptor before anything is posted, and the remote key's scope.

use std::sync::Arc;

use handoff_gpu::DeviceBuffer;
use handoff_transport::data::{DataError, UcxDataPlane, UcxPeer, UcxPlaneOptions};
use handoff_transport::wire::messages::LayoutDescriptor;
use handoff_transport::{RankInfo, Region};

use super::data::{DataPlane, GrantTable, PlaneTransfer};
use handoff_actors::link::TransferFuture;

/// Moves blocks with UCX.
pub struct UcxPlane {
    plane: Arc<UcxDataPlane>,
    grants: Arc<GrantTable>,
    /// Same-host copies ([`DataPlane::same_host_copies`]: the kernel's between host
    /// memory, CUDA IPC between device memory): on unless [`SAME_HOST_ENV`] says `0`/`off`.
    same_host: bool,
    /// Whether our memory is registered by address (an engine's tensors) rather than
    /// allocated by UCX, which same-host peers' UCX maps through shared memory and copies
    /// at memory speed ([`DataPlane::offers_same_host_copies`]).
    registered: bool,
}

/// Environment variable that turns same-host copies off (`0`, `off`, `false`, `no`), the
/// kernel's and CUDA IPC's alike: UCX then moves every transfer (for comparisons, or a
/// host whose kernel refuses them).
pub const SAME_HOST_ENV: &str = "HANDOFF_SAME_HOST_COPIES";

/// Whether [`SAME_HOST_ENV`] leaves same-host copies on.
pub fn same_host_copies_enabled() -> bool {
    !matches!(
        std::env::var(SAME_HOST_ENV).map(|v| v.trim().to_ascii_lowercase()),
        Ok(v) if matches!(v.as_str(), "0" | "off" | "false" | "no")
    )
}

impl UcxPlane {
    fn with_plane(plane: UcxDataPlane, registered: bool) -> UcxPlane {
        UcxPlane {
            plane: Arc::new(plane),
            grants: Arc::default(),
            same_host: same_host_copies_enabled(),
            registered,
        }
    }
}

impl UcxPlane {
    /// Starts the UCX thread and allocates the region through UCX (`blocks` × `block_bytes`).
    /// With no loadable libucp this is `DataError::Ucx(LibraryNotFound ..)`
    /// ([`DataError::is_ucx_unavailable`]).
    pub fn start(blocks: u32, block_bytes: usize, me: &RankInfo) -> Result<UcxPlane, DataError> {
        Self::start_with(blocks, block_bytes, me, UcxPlaneOptions::default())
    }

    /// [`UcxPlane::start`] with the thread's options: a CUDA device to bind (so that it can
    /// read and write peers' device memory), its nice value.
    pub fn start_with(
        blocks: u32,
        block_bytes: usize,
        me: &RankInfo,
        options: UcxPlaneOptions,
    ) -> Result<UcxPlane, DataError> {
        let plane = UcxDataPlane::start(blocks, block_bytes, me, options)?;
        Ok(UcxPlane::with_plane(plane, false))
    }

    /// Starts the UCX thread over the first `blocks` × `block_bytes` bytes of a CUDA
    /// allocation (the engine's KV cache), registered as CUDA memory. Needs a UCX built
    /// with CUDA (`HANDOFF_UCX_LIB`, e.g. the `libucx-cu12` wheel's `libucp.so`).
    pub fn start_on_device(
        buffer: Arc<DeviceBuffer>,
        blocks: u32,
        block_bytes: usize,
        me: &RankInfo,
        options: UcxPlaneOptions,
    ) -> Result<UcxPlane, DataError> {
        let plane = UcxDataPlane::start_on_device(buffer, blocks, block_bytes, me, options)?;
        Ok(UcxPlane::with_plane(plane, true))
    }

    /// Starts the UCX thread over an engine's KV memory as it is: every range of
    /// `region`'s layout (host or CUDA) registered by address, one remote key per range;
    /// nothing allocated or copied. `options.cuda_device` binds the UCX thread to a device
    /// for a host region that exchanges with peers' device memory.
    pub fn start_on_region(
        region: Arc<Region>,
        me: &RankInfo,
        options: UcxPlaneOptions,
    ) -> Result<UcxPlane, DataError> {
        let plane = UcxDataPlane::start_on_region(region, me, options)?;
        Ok(UcxPlane::with_plane(plane, true))
    }

    /// The region (UCX-allocated host memory, or the registered device buffer): give it
    /// to the runtime and the engine.
    pub fn region(&self) -> Arc<Region> {
        self.plane.region().clone()
    }

    /// The loaded UCX version and library.
    pub fn version(&self) -> &str {
        self.plane.version()
    }

    fn transfer(&self, t: PlaneTransfer<'_>, write: bool) -> TransferFuture {
        // The peer's layout from its hello: one remote key per range, checked by the
        // plane (once per peer layout) before anything is posted.
        // `process` is set only when `same_host_copies()` said yes at connect.
        let peer = UcxPeer::from_layout(t.peer.to_string(), t.peer_data.to_vec(), t.peer_layout)
            .with_process(t.process);
        let (src, dst, slices, id, lease) = (t.src, t.dst, t.slices, t.id, t.lease);
        let (plane, id, deadline) = (self.plane.clone(), id.clone(), t.deadline);
        Box::pin(async move {
            let result = match (write, lease) {
                // A one-sided write into the peer's memory: fenced by our lease with it.
                (true, Some(lease)) => {
                    plane
                        .write_leased(&id, &peer, &src, &dst, &slices, deadline, lease)
                        .await
                }
                (true, None) => {
                    plane
                        .write_slices(&id, &peer, &src, &dst, &slices, deadline)
                        .await
                }
                (false, _) => {
                    plane
                        .read_slices(&id, &peer, &src, &dst, &slices, deadline)
                        .await
                }
            };
            Ok(result?)
        })
    }
}

impl DataPlane for UcxPlane {
    fn name(&self) -> &'static str {
        "ucx"
    }

    fn descriptor(&self) -> LayoutDescriptor {
        self.plane.layout_descriptor()
    }

    fn address(&self) -> String {
        format!("ucx:{}", self.plane.descriptor().name)
    }

    fn data_descriptor(&self) -> Vec<u8> {
        self.plane.descriptor().worker_address.clone()
    }

    fn one_sided(&self) -> bool {
        true
    }

    fn same_host_copies(&self) -> bool {
        self.same_host
    }

    fn offers_same_host_copies(&self) -> bool {
        self.same_host && self.registered
    }

    fn grants(&self) -> &Arc<GrantTable> {
        &self.grants
    }

    fn write(&self, t: PlaneTransfer<'_>) -> TransferFuture {
        self.transfer(t, true)
    }

    fn read(&self, t: PlaneTransfer<'_>) -> TransferFuture {
        self.transfer(t, false)
    }
}
