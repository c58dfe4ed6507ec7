//! [`Lease`]: until when a peer surely still counts us as alive, so that our one-sided
//! writes into its memory may still be posted.
//!
//! A writer over a one-sided plane (UCX put) cannot be refused by its target, so it fences
//! itself: it posts a write only while its lease with the target holds, checked
//! immediately before each operation. The control plane extends the lease whenever the
//! target proves it heard us: a heartbeat we sent at `t` that the target echoes means the
//! target will not take us as lost before `t + its loss timeout`. A writer frozen (or cut
//! off) past that finds its lease expired when it resumes, even if the target's old
//! heartbeats are still queued for it, because only echoes of what it sent before the
//! freeze can be among them. The control plane revokes the lease at once when it loses the
//! peer.
//!
//! Shared between the control loop (which extends and revokes it) and a data plane's
//! thread (which reads it before every post): one atomic, no lock.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::data::DataError;

/// The instant leases count from (first use in the process).
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn nanos(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(epoch()).as_nanos()).unwrap_or(u64::MAX)
}

/// Until when writes to one peer may be posted. Starts expired; see the module docs.
#[derive(Debug, Default)]
pub struct Lease {
    /// Nanoseconds after [`epoch`] until which the lease holds (0: never held).
    until: AtomicU64,
    revoked: AtomicBool,
}

impl Lease {
    /// An expired lease.
    pub fn new() -> Lease {
        epoch();
        Lease::default()
    }

    /// Extends the lease to `until`, if that is later than it holds now. A revoked lease
    /// stays revoked.
    pub fn extend_to(&self, until: Instant) {
        self.until.fetch_max(nanos(until), Ordering::AcqRel);
    }

    /// Ends the lease for good (the peer was lost).
    pub fn revoke(&self) {
        self.revoked.store(true, Ordering::Release);
    }

    /// Whether a write may be posted at `now`.
    pub fn holds_at(&self, now: Instant) -> bool {
        !self.revoked.load(Ordering::Acquire) && nanos(now) < self.until.load(Ordering::Acquire)
    }

    /// How long ago the lease ended at `now` (`None` while it holds; `Duration::MAX` for a
    /// revoked lease), for error messages.
    pub fn expired_for(&self, now: Instant) -> Option<Duration> {
        if self.revoked.load(Ordering::Acquire) {
            return Some(Duration::MAX);
        }
        let until = self.until.load(Ordering::Acquire);
        let now = nanos(now);
        (now >= until).then(|| Duration::from_nanos(now - until))
    }

    /// A write's outcome as its writer sees it at `now`: a success seen only after the
    /// lease ended is [`DataError::ConfirmedLate`]. The bytes landed while the peer still
    /// counted us alive (a one-sided plane posted each operation under the lease; a
    /// two-sided one was answered by the peer's grant check), but the peer may have taken
    /// us for lost since and failed the request: saying `Done` would contradict it.
    /// Failures stay as they are.
    pub fn confirm(
        &self,
        result: Result<(), DataError>,
        peer: &str,
        now: Instant,
    ) -> Result<(), DataError> {
        result?;
        match self.expired_for(now) {
            None => Ok(()),
            Some(ago) => Err(DataError::ConfirmedLate {
                peer: peer.to_string(),
                ago: (ago != Duration::MAX).then_some(ago),
            }),
        }
    }

    /// Whether the lease was revoked.
    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_holds_until_its_end_only_grows_and_revocation_is_final() {
        let t = Instant::now();
        let lease = Lease::new();
        assert!(!lease.holds_at(t));
        lease.extend_to(t + Duration::from_secs(2));
        assert!(lease.holds_at(t + Duration::from_secs(1)));
        assert!(!lease.holds_at(t + Duration::from_secs(2)));
        assert_eq!(
            lease.expired_for(t + Duration::from_secs(3)),
            Some(Duration::from_secs(1))
        );
        // An older proof does not shorten it.
        lease.extend_to(t + Duration::from_secs(1));
        assert!(lease.holds_at(t + Duration::from_millis(1500)));
        lease.revoke();
        assert!(!lease.holds_at(t));
        lease.extend_to(t + Duration::from_secs(60));
        assert!(!lease.holds_at(t), "a revoked lease is not revived");
        assert_eq!(lease.expired_for(t), Some(Duration::MAX));
    }

    #[test]
    fn a_leased_write_seen_done_only_after_its_lease_ended_is_not_done() {
        let t = Instant::now();
        let lease = Lease::new();
        lease.extend_to(t + Duration::from_secs(2));
        // Seen within the lease: done.
        assert!(lease
            .confirm(Ok(()), "D", t + Duration::from_secs(1))
            .is_ok());
        // Seen after it (the writer stopped between its last post and the answer): refused,
        // saying how late.
        let late = lease.confirm(Ok(()), "D", t + Duration::from_secs(5));
        assert!(
            matches!(&late, Err(DataError::ConfirmedLate { peer, ago: Some(ago) })
                if peer == "D" && *ago == Duration::from_secs(3)),
            "{late:?}"
        );
        // A failure stays the failure it was.
        let timeout = DataError::Timeout {
            peer: "D".into(),
            op: "flush",
            after: Duration::ZERO,
        };
        let failed = lease.confirm(Err(timeout), "D", t + Duration::from_secs(5));
        assert!(
            matches!(failed, Err(DataError::Timeout { .. })),
            "{failed:?}"
        );
        // Revoked (the peer was lost): refused, and the message says so.
        lease.revoke();
        let revoked = lease.confirm(Ok(()), "D", t).unwrap_err();
        assert!(revoked.to_string().contains("revoked"), "{revoked}");
    }
}
