//! Who makes room for a newcomer at a listener: the rule the control listener (ZMTP) and
//! the TCP data server share, as plain data.
//!
//! Connections that have not yet been admitted as peers (no valid hello or registration)
//! are bounded in all and per source address. At a bound the oldest pending connection
//! goes (of the newcomer's own source, for the per-source bound): strangers can only push
//! each other out, one source's flood evicts its own connections before anyone else's, an
//! honest newcomer's short exchange gets through, and admitted peers are never evicted.

use std::net::IpAddr;

/// Which bound a newcomer met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Bound {
    /// Every place is taken.
    Full,
    /// Too many connections are pending.
    Pending,
    /// Too many connections from the newcomer's address are pending.
    Source,
}

/// The bounds of one listener.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Connections in all.
    pub(crate) total: usize,
    /// Connections not yet admitted.
    pub(crate) pending: usize,
    /// Connections not yet admitted, from one address.
    pub(crate) per_source: usize,
}

/// Whether a connection from `source` fits beside `open` connections, of which `pending`
/// (oldest first: `(key, source)`) are not yet admitted. `Ok(None)`: it fits; `Ok(Some)`:
/// it fits once the named connection is evicted; `Err`: nothing may be evicted (every
/// place is an admitted peer's), refuse it.
pub(crate) fn admission<K: Copy>(
    open: usize,
    pending: impl Iterator<Item = (K, IpAddr)> + Clone,
    source: IpAddr,
    limits: &Limits,
) -> Result<Option<(Bound, K)>, Bound> {
    let oldest = |same_source: bool| {
        pending
            .clone()
            .find(|(_, from)| !same_source || *from == source)
            .map(|(key, _)| key)
    };
    let (mut all, mut same) = (0usize, 0usize);
    for (_, from) in pending.clone() {
        all += 1;
        same += usize::from(from == source);
    }
    // The newcomer's own address first: its oldest makes room at any bound, so a source
    // over its share never pushes out another's.
    if same >= limits.per_source {
        return oldest(true)
            .map(|k| Some((Bound::Source, k)))
            .ok_or(Bound::Source);
    }
    if open >= limits.total {
        return oldest(false)
            .map(|k| Some((Bound::Full, k)))
            .ok_or(Bound::Full);
    }
    if all >= limits.pending {
        return oldest(false)
            .map(|k| Some((Bound::Pending, k)))
            .ok_or(Bound::Pending);
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIMITS: Limits = Limits {
        total: 8,
        pending: 6,
        per_source: 3,
    };

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    #[test]
    fn a_flooding_source_evicts_its_own_oldest() {
        let pending = [(1, ip(1)), (2, ip(2)), (3, ip(1)), (4, ip(1))];
        let got = admission(4, pending.iter().copied(), ip(1), &LIMITS);
        assert_eq!(got, Ok(Some((Bound::Source, 1))));
        // Another source is not held to the first's bound.
        assert_eq!(
            admission(4, pending.iter().copied(), ip(2), &LIMITS),
            Ok(None)
        );
    }

    #[test]
    fn when_every_place_is_a_peers_the_newcomer_is_refused() {
        let none: [(u32, IpAddr); 0] = [];
        assert_eq!(
            admission(8, none.iter().copied(), ip(1), &LIMITS),
            Err(Bound::Full)
        );
        let one = [(7, ip(3))];
        assert_eq!(
            admission(8, one.iter().copied(), ip(1), &LIMITS),
            Ok(Some((Bound::Full, 7)))
        );
    }

    proptest! {
        /// Replaying arrivals through the rule keeps every bound, and never evicts an
        /// admitted connection.
        #[test]
        fn arrivals_keep_every_bound(
            arrivals in proptest::collection::vec((0u8..4, any::<bool>()), 1..60)
        ) {
            // (key, source, admitted), oldest first.
            let mut conns: Vec<(usize, IpAddr, bool)> = Vec::new();
            for (key, (source, admit_now)) in arrivals.into_iter().enumerate() {
                let pending: Vec<(usize, IpAddr)> =
                    conns.iter().filter(|c| !c.2).map(|c| (c.0, c.1)).collect();
                match admission(conns.len(), pending.iter().copied(), ip(source), &LIMITS) {
                    Ok(None) => {}
                    Ok(Some((_, evicted))) => {
                        let at = conns.iter().position(|c| c.0 == evicted).unwrap();
                        prop_assert!(!conns[at].2, "an admitted connection was evicted");
                        conns.remove(at);
                    }
                    Err(_) => {
                        prop_assert!(conns.iter().all(|c| c.2));
                        continue;
                    }
                }
                conns.push((key, ip(source), false));
                if admit_now {
                    conns.last_mut().unwrap().2 = true;
                }
                let pending = conns.iter().filter(|c| !c.2);
                prop_assert!(conns.len() <= LIMITS.total);
                prop_assert!(pending.clone().count() <= LIMITS.pending);
                for s in 0..4 {
                    prop_assert!(pending.clone().filter(|c| c.1 == ip(s)).count() <= LIMITS.per_source);
                }
            }
        }
    }
}
