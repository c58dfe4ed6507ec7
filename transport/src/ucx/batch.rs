//! The batched transfer the runtime uses: many (local offset, remote address, length)
//! segments between local regions and remote regions (one registration and one remote key
//! per range of a KV layout), coalesced, posted with a bound on operations in flight,
//! flushed, all within one deadline.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use super::memory::MemoryRegion;
use super::sys;
use super::worker::{Endpoint, EndpointInner, RemoteKey};
use super::{UcxError, OPS_INFLIGHT_MAX, SEGMENTS_PER_BATCH_MAX};
use crate::lease::Lease;

/// Operations posted between two looks at the clock while posting (waiting for
/// completions looks every round): a look costs tens of nanoseconds, as much as posting a
/// small segment over shared memory, and 16 posts take microseconds, far below any deadline.
const OPS_PER_DEADLINE_CHECK: usize = 16;

/// One contiguous piece of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Offset into the local [`MemoryRegion`].
    pub local_offset: usize,
    /// Absolute address in the peer's region (the peer's `MemoryRegion::address` + offset).
    pub remote_addr: u64,
    /// Length in bytes (non-zero).
    pub len: usize,
}

/// One contiguous piece of a transfer between one of several local regions and one of
/// several remote keys ([`Endpoint::transfer_ranges`]): a KV layout registers each of its
/// ranges on its own, so a block's segments name the range on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RangeSegment {
    /// Index of the local [`MemoryRegion`] in the call's `locals`.
    pub local: u32,
    /// Offset into that local region.
    pub local_offset: usize,
    /// Index of the [`RemoteKey`] in the call's `remotes`.
    pub remote: u32,
    /// Absolute address in that remote region.
    pub remote_addr: u64,
    /// Length in bytes (non-zero).
    pub len: usize,
}

impl RangeSegment {
    /// Whether `next` continues this segment on both sides, in the same two regions.
    fn is_followed_by(&self, next: &RangeSegment) -> bool {
        self.local == next.local
            && self.remote == next.remote
            && self.local_offset.checked_add(self.len) == Some(next.local_offset)
            && u64::try_from(self.len)
                .ok()
                .and_then(|l| self.remote_addr.checked_add(l))
                == Some(next.remote_addr)
    }

    /// Appends `seg` to `out`, merged into the last segment when it continues it on both
    /// sides (a run that would overflow `usize` starts a new segment).
    pub fn push_coalesced(out: &mut Vec<RangeSegment>, seg: RangeSegment) {
        if let Some(last) = out.last_mut() {
            if last.is_followed_by(&seg) {
                if let Some(len) = last.len.checked_add(seg.len) {
                    last.len = len;
                    return;
                }
            }
        }
        out.push(seg);
    }
}

/// Merges segments into runs per local range, across interleaved ranges. A multi-range
/// layout yields a block's pieces range by range (K0, V0, K1, ... for an engine's per-layer
/// tensors), so consecutive blocks continue each other range by range and never segment
/// after segment: [`RangeSegment::push_coalesced`] alone would post one operation per
/// block and range (16,384 for 2,048 one-token pages over 8 ranges) where this posts one
/// per range and contiguous run.
///
/// It holds one open run per local range (`ranges` of them, the layout's count, bounded by
/// its limits); a run closes into the output when the next segment of its range does not
/// continue it, and at [`finish`](Self::finish). The order of the output is not the order
/// of the input: the runs touch disjoint bytes, so the order of operations does not matter.
#[derive(Debug)]
pub struct RangeCoalescer {
    open: Vec<Option<RangeSegment>>,
}

impl RangeCoalescer {
    /// A coalescer for segments whose local range is below `ranges` (others pass through,
    /// merged only with the previous output segment).
    pub fn new(ranges: usize) -> Self {
        Self {
            open: vec![None; ranges],
        }
    }

    /// Adds `seg`: extends its range's open run, or closes that run into `out` and opens
    /// a new one.
    pub fn push(&mut self, seg: RangeSegment, out: &mut Vec<RangeSegment>) {
        let Some(slot) = self.open.get_mut(seg.local as usize) else {
            return RangeSegment::push_coalesced(out, seg);
        };
        if let Some(run) = slot {
            if run.is_followed_by(&seg) {
                if let Some(len) = run.len.checked_add(seg.len) {
                    run.len = len;
                    return;
                }
            }
            out.push(*run);
        }
        *slot = Some(seg);
    }

    /// Closes every open run into `out`.
    pub fn finish(&mut self, out: &mut Vec<RangeSegment>) {
        out.extend(self.open.iter_mut().filter_map(Option::take));
    }
}

/// Which way the bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Local region → peer region (RDMA write, `ucp_put_nbx`), then an endpoint flush.
    Put,
    /// Peer region → local region (RDMA read, `ucp_get_nbx`).
    Get,
}

/// What a batched transfer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferStats {
    /// Segments given.
    pub segments: usize,
    /// UCX operations posted after coalescing.
    pub ops: usize,
    /// Bytes moved.
    pub bytes: u64,
}

/// Merges each segment into the previous one when both its local and its remote range
/// continue the previous segment's, in the given order. Lengths are summed with overflow
/// checks (a run that would overflow starts a new segment).
pub fn coalesce(segments: &[Segment]) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::with_capacity(segments.len());
    for seg in segments {
        if let Some(last) = out.last_mut() {
            let local_next = last.local_offset.checked_add(last.len);
            let remote_next = u64::try_from(last.len)
                .ok()
                .and_then(|l| last.remote_addr.checked_add(l));
            let merged_len = last.len.checked_add(seg.len);
            if local_next == Some(seg.local_offset) && remote_next == Some(seg.remote_addr) {
                if let Some(len) = merged_len {
                    last.len = len;
                    continue;
                }
            }
        }
        out.push(*seg);
    }
    out
}

/// Checks every segment against its two regions before anything is posted; returns the
/// bytes the segments move.
fn validate(
    locals: &[&MemoryRegion],
    remotes: &[&RemoteKey],
    segments: &[RangeSegment],
) -> Result<u64, UcxError> {
    if segments.len() > SEGMENTS_PER_BATCH_MAX {
        return Err(UcxError::TooManySegments {
            count: segments.len(),
            max: SEGMENTS_PER_BATCH_MAX,
        });
    }
    let mut bytes = 0u64;
    for seg in segments {
        if seg.len == 0 {
            return Err(UcxError::InvalidArgument {
                what: format!("zero-length segment {seg:?}"),
            });
        }
        let local = locals
            .get(seg.local as usize)
            .ok_or_else(|| UcxError::InvalidArgument {
                what: format!(
                    "segment names local region {} of {}",
                    seg.local,
                    locals.len()
                ),
            })?;
        let remote = remotes
            .get(seg.remote as usize)
            .ok_or_else(|| UcxError::InvalidArgument {
                what: format!(
                    "segment names remote key {} of {}",
                    seg.remote,
                    remotes.len()
                ),
            })?;
        local.range_ptr(seg.local_offset, seg.len)?;
        let len = seg.len as u64;
        let offset = seg.remote_addr.wrapping_sub(remote.base());
        let inside = seg.remote_addr >= remote.base()
            && offset
                .checked_add(len)
                .is_some_and(|end| end <= remote.len());
        if !inside {
            return Err(UcxError::OutOfRange {
                what: "remote region",
                offset,
                len,
                limit: remote.len(),
            });
        }
        bytes = bytes.saturating_add(len);
    }
    Ok(bytes)
}

/// Requests posted and not yet complete; freed (and their endpoint force-closed) on error.
struct InFlight<'a> {
    ep: &'a EndpointInner,
    op: &'static str,
    requests: Vec<*mut c_void>,
}

impl InFlight<'_> {
    /// Polls every request once, dropping completed ones; the first failure is returned.
    fn reap(&mut self) -> Result<usize, UcxError> {
        let before = self.requests.len();
        let mut i = 0;
        while i < self.requests.len() {
            match self.ep.worker.poll(self.op, self.requests[i]) {
                None => i += 1,
                Some(result) => {
                    self.requests.swap_remove(i);
                    result?;
                }
            }
        }
        Ok(before - self.requests.len())
    }

    /// Waits until at most `target` requests remain, or the deadline passes.
    fn drain_to(
        &mut self,
        target: usize,
        started: Instant,
        deadline: Instant,
    ) -> Result<(), UcxError> {
        let mut idle = 0;
        while self.requests.len() > target {
            if self.reap()? > 0 {
                continue;
            }
            if Instant::now() >= deadline {
                return Err(UcxError::Timeout {
                    op: self.op,
                    after: started.elapsed(),
                });
            }
            self.ep.worker.progress_or_yield(&mut idle);
        }
        Ok(())
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.requests.is_empty() {
            return;
        }
        // Only an error leaves requests behind. Release them (UCX frees one still in flight
        // when it completes); `transfer` then force-closes the endpoint, which cancels them.
        for request in self.requests.drain(..) {
            self.ep.worker.free(request);
        }
    }
}

impl Endpoint {
    /// Writes `len` bytes from `local` at `local_offset` to the peer's `remote_addr`, then
    /// flushes, all before `deadline`.
    pub fn put(
        &self,
        local: &MemoryRegion,
        local_offset: usize,
        remote: &RemoteKey,
        remote_addr: u64,
        len: usize,
        deadline: Instant,
    ) -> Result<(), UcxError> {
        let seg = [Segment {
            local_offset,
            remote_addr,
            len,
        }];
        self.transfer(Direction::Put, local, remote, &seg, deadline)
            .map(|_| ())
    }

    /// Reads `len` bytes from the peer's `remote_addr` into `local` at `local_offset`,
    /// before `deadline`.
    pub fn get(
        &self,
        local: &MemoryRegion,
        local_offset: usize,
        remote: &RemoteKey,
        remote_addr: u64,
        len: usize,
        deadline: Instant,
    ) -> Result<(), UcxError> {
        let seg = [Segment {
            local_offset,
            remote_addr,
            len,
        }];
        self.transfer(Direction::Get, local, remote, &seg, deadline)
            .map(|_| ())
    }

    /// The batched transfer: validates every segment against both regions (nothing is
    /// posted if one is out of range), coalesces contiguous runs, posts them with at most
    /// [`OPS_INFLIGHT_MAX`] in flight, waits for all, and for [`Direction::Put`] flushes
    /// the endpoint, all before `deadline`. On any error or timeout the endpoint is
    /// force-closed (cancelling what was in flight) and the error returned.
    pub fn transfer(
        &self,
        direction: Direction,
        local: &MemoryRegion,
        remote: &RemoteKey,
        segments: &[Segment],
        deadline: Instant,
    ) -> Result<TransferStats, UcxError> {
        if segments.len() > SEGMENTS_PER_BATCH_MAX {
            return Err(UcxError::TooManySegments {
                count: segments.len(),
                max: SEGMENTS_PER_BATCH_MAX,
            });
        }
        let ranged: Vec<RangeSegment> = segments
            .iter()
            .map(|s| RangeSegment {
                local: 0,
                local_offset: s.local_offset,
                remote: 0,
                remote_addr: s.remote_addr,
                len: s.len,
            })
            .collect();
        self.transfer_ranges(direction, &[local], &[remote], &ranged, deadline)
    }

    /// [`Endpoint::transfer`] between several local regions and several remote keys (one
    /// per range of a KV layout): each segment names its two regions. Every segment is
    /// checked against both before anything is posted; segments that continue each other
    /// in the same two regions are merged; each operation is posted with its local
    /// region's registration.
    pub fn transfer_ranges(
        &self,
        direction: Direction,
        locals: &[&MemoryRegion],
        remotes: &[&RemoteKey],
        segments: &[RangeSegment],
        deadline: Instant,
    ) -> Result<TransferStats, UcxError> {
        self.transfer_ranges_leased(direction, locals, remotes, segments, deadline, None)
    }

    /// [`Endpoint::transfer_ranges`] under a writer's [`Lease`] with the peer: the lease is
    /// checked immediately before every operation is posted, and once it has ended nothing
    /// more is posted ([`UcxError::LeaseExpired`]; the endpoint is force-closed, cancelling
    /// what UCX still had queued). At most [`OPS_INFLIGHT_MAX`] operations were posted
    /// under an earlier check.
    pub fn transfer_ranges_leased(
        &self,
        direction: Direction,
        locals: &[&MemoryRegion],
        remotes: &[&RemoteKey],
        segments: &[RangeSegment],
        deadline: Instant,
        lease: Option<&Lease>,
    ) -> Result<TransferStats, UcxError> {
        if locals
            .iter()
            .any(|l| !std::rc::Rc::ptr_eq(l.context(), &self.inner.worker.ctx))
        {
            return Err(UcxError::ContextMismatch);
        }
        if remotes.iter().any(|r| !r.belongs_to(self)) {
            return Err(UcxError::InvalidArgument {
                what: "remote key was unpacked on another endpoint".into(),
            });
        }
        let bytes = validate(locals, remotes, segments)?;
        let mut ops = Vec::with_capacity(segments.len());
        for seg in segments {
            RangeSegment::push_coalesced(&mut ops, *seg);
        }
        let ep = self.inner.live()?;
        let mut rkeys = Vec::with_capacity(remotes.len());
        for remote in remotes {
            rkeys.push(
                remote
                    .inner
                    .handle()
                    .ok_or_else(|| UcxError::EndpointClosed {
                        reason: Box::new(UcxError::InvalidArgument {
                            what: "remote key destroyed with its endpoint".into(),
                        }),
                    })?,
            );
        }
        let result = self.post_all(direction, locals, ep, &rkeys, &ops, deadline, lease);
        if let Err(error) = &result {
            self.inner.fail(error.clone());
        }
        result?;
        if direction == Direction::Put {
            self.flush(deadline)?;
        }
        // A peer failure recorded while we waited must not read as success.
        self.inner.live()?;
        Ok(TransferStats {
            segments: segments.len(),
            ops: ops.len(),
            bytes,
        })
    }

    // The batch's pieces as `transfer_ranges_leased` checked them: one private funnel.
    #[allow(clippy::too_many_arguments)]
    fn post_all(
        &self,
        direction: Direction,
        locals: &[&MemoryRegion],
        ep: sys::ucp_ep_h,
        rkeys: &[sys::ucp_rkey_h],
        ops: &[RangeSegment],
        deadline: Instant,
        lease: Option<&Lease>,
    ) -> Result<(), UcxError> {
        let worker = &self.inner.worker;
        let api = worker.api;
        let op = match direction {
            Direction::Put => "ucp_put_nbx",
            Direction::Get => "ucp_get_nbx",
        };
        // One parameter block per local region: its memory type and registration.
        let params: Vec<sys::ucp_request_param_t> = locals
            .iter()
            .map(|local| {
                let mut param = sys::ucp_request_param_t::empty();
                param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
                param.memory_type = match local.memory_type() {
                    super::MemoryType::Host => sys::UCS_MEMORY_TYPE_HOST,
                    super::MemoryType::Cuda => sys::UCS_MEMORY_TYPE_CUDA,
                };
                if worker.ctx.memh_param {
                    param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
                    param.memh = local.memh();
                }
                param
            })
            .collect();
        let started = Instant::now();
        let mut in_flight = InFlight {
            ep: &self.inner,
            op,
            requests: Vec::with_capacity(OPS_INFLIGHT_MAX),
        };
        for (i, seg) in ops.iter().enumerate() {
            if in_flight.requests.len() >= OPS_INFLIGHT_MAX {
                in_flight.drain_to(OPS_INFLIGHT_MAX - 1, started, deadline)?;
            }
            let (Some(local), Some(param), Some(&rkey)) = (
                locals.get(seg.local as usize),
                params.get(seg.local as usize),
                rkeys.get(seg.remote as usize),
            ) else {
                return Err(UcxError::InvalidArgument {
                    what: format!("segment {seg:?} names a region the call does not have"),
                });
            };
            let buffer = local.range_ptr(seg.local_offset, seg.len)?;
            if let Some(lease) = lease {
                // The writer's fence: checked immediately before each post.
                if let Some(ago) = lease.expired_for(Instant::now()) {
                    return Err(UcxError::LeaseExpired {
                        posted: i,
                        ago: (ago != Duration::MAX).then_some(ago),
                    });
                }
            }
            // SAFETY: live endpoint and rkey of this endpoint; `buffer..+len` lies in the
            // registered local region (validated), which outlives the operation: we wait
            // for it here, or force-close the endpoint (cancelling it) before returning.
            let ptr = unsafe {
                match direction {
                    Direction::Put => (api.ucp_put_nbx)(
                        ep,
                        buffer.cast_const().cast(),
                        seg.len,
                        seg.remote_addr,
                        rkey,
                        param,
                    ),
                    Direction::Get => {
                        (api.ucp_get_nbx)(ep, buffer.cast(), seg.len, seg.remote_addr, rkey, param)
                    }
                }
            };
            if let Some(request) = worker.poll_start(op, ptr)? {
                in_flight.requests.push(request);
            }
            if i % OPS_PER_DEADLINE_CHECK == OPS_PER_DEADLINE_CHECK - 1
                && Instant::now() >= deadline
            {
                return Err(UcxError::Timeout {
                    op,
                    after: started.elapsed(),
                });
            }
        }
        in_flight.drain_to(0, started, deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(local: u32, local_offset: usize, remote: u32, remote_addr: u64) -> RangeSegment {
        RangeSegment {
            local,
            local_offset,
            remote,
            remote_addr,
            len: 8,
        }
    }

    #[test]
    fn segments_merge_only_when_adjacent_on_both_sides_in_the_same_two_ranges() {
        let mut out = Vec::new();
        for s in [
            seg(0, 0, 0, 100),
            seg(0, 8, 0, 108),  // continues both sides: merged
            seg(1, 16, 0, 116), // another local range: not merged
            seg(1, 24, 1, 124), // another remote range: not merged
            seg(1, 32, 1, 140), // remote gap: not merged
            seg(1, 40, 1, 148), // continues: merged
        ] {
            RangeSegment::push_coalesced(&mut out, s);
        }
        let lens: Vec<usize> = out.iter().map(|s| s.len).collect();
        assert_eq!(lens, [16, 8, 8, 16]);
        // A run that would overflow starts a new segment instead.
        let mut out = vec![RangeSegment {
            len: usize::MAX - 4,
            ..seg(0, 0, 0, 0)
        }];
        RangeSegment::push_coalesced(&mut out, seg(0, usize::MAX - 4, 0, (usize::MAX - 4) as u64));
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn interleaved_ranges_coalesce_range_by_range() {
        // Three blocks over two ranges, visited block by block (range 0, range 1, range 0,
        // ...), the way a per-layer layout yields them: one run per range.
        let mut c = RangeCoalescer::new(2);
        let mut out = Vec::new();
        for b in 0..3u64 {
            let at = b as usize * 8;
            c.push(seg(0, at, 0, 1000 + b * 8), &mut out);
            c.push(seg(1, at, 1, 5000 + b * 8), &mut out);
        }
        assert!(out.is_empty(), "runs stay open until they break or finish");
        c.finish(&mut out);
        out.sort_by_key(|s| s.local);
        assert_eq!(
            out,
            [
                RangeSegment {
                    len: 24,
                    ..seg(0, 0, 0, 1000)
                },
                RangeSegment {
                    len: 24,
                    ..seg(1, 0, 1, 5000)
                },
            ]
        );
    }

    #[test]
    fn a_break_in_one_range_closes_only_that_run() {
        let mut c = RangeCoalescer::new(2);
        let mut out = Vec::new();
        c.push(seg(0, 0, 0, 100), &mut out);
        c.push(seg(1, 0, 1, 500), &mut out);
        c.push(seg(0, 8, 0, 300), &mut out); // remote gap in range 0: its run closes
        c.push(seg(1, 8, 1, 508), &mut out); // range 1 continues
        assert_eq!(out, [seg(0, 0, 0, 100)]);
        // A range beyond the count passes through.
        c.push(seg(7, 0, 0, 900), &mut out);
        c.finish(&mut out);
        let total: usize = out.iter().map(|s| s.len).sum();
        assert_eq!(total, 8 * 5, "every byte once");
        assert_eq!(out.len(), 4);
    }
}
