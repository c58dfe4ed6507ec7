//! What a worker knows about its peers' liveness, as plain data: the incarnation each
//! announced, which incarnations were lost, when each was last heard, our heartbeats
//! awaiting an echo, and our writer's lease with each.
//!
//! The control loop (`control.rs`) owns one [`PeerTable`], feeds it what it sees
//! (hellos, messages, heartbeats, ticks) with the time, and does what it answers: fail the
//! requests of a restarted or silent peer, answer a heartbeat, drop a stale message. It
//! never touches a socket, a clock or a task, so property tests drive it directly
//! (`net/tests/peer_table.rs`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_transport::lease::Lease;

use handoff_actors::machine::Peer;

/// Our heartbeats remembered per peer, to turn an echo into the time we sent it: at one
/// heartbeat per interval, far more than an echo can lag behind. Worst case: 16 bytes a
/// beat, 1 KiB a peer.
pub const BEATS_REMEMBERED: usize = 64;

/// What one peer's announced incarnation means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Incarnation {
    /// The first we hear of it.
    First,
    /// The one we know.
    Unchanged,
    /// Another one, after the one we knew was lost: nothing depends on the old one any more.
    Back {
        /// The lost incarnation.
        old: u64,
    },
    /// Another one while the one we knew was live: that one is gone, and what depended on it
    /// must fail now.
    Restarted {
        /// The incarnation that is gone.
        old: u64,
    },
    /// An older one than the one we know (incarnations grow with every start): a process
    /// that a newer one has replaced, back from a stop, say. Refused: it must not displace
    /// its successor, nor speak for it.
    Stale {
        /// The incarnation we know.
        current: u64,
    },
}

#[derive(Debug, Default)]
struct Liveness {
    /// The incarnation the peer announced.
    incarnation: Option<u64>,
    last_heard: Option<Instant>,
    /// Our heartbeats not yet echoed: `(seq, when sent)`, oldest first, at most
    /// [`BEATS_REMEMBERED`].
    beats: VecDeque<(u64, Instant)>,
    /// The latest heartbeat seq it sent us: echoed in ours.
    heard_seq: u64,
    /// Our writer's lease with it (shared with the data plane).
    lease: Option<Arc<Lease>>,
}

/// The liveness of every peer a worker has heard of. See the [module docs](self).
///
/// Peers are named by `P`: a [`Peer`] in the control loop; the simulator, which runs this
/// very table for a thousand workers, names them by index (cheaper to compare).
#[derive(Debug)]
pub struct PeerTable<P = Peer> {
    /// How long a peer may stay silent before it is lost.
    loss_timeout: Duration,
    /// Peers whose current incarnation was not lost: those a tick looks at.
    peers: BTreeMap<P, Liveness>,
    /// Peers whose current incarnation was lost and its requests failed, with that
    /// incarnation: kept only so that its late messages are known stale. Apart, so that a
    /// tick never walks them, and only the incarnation, so that a worker that served a
    /// thousand peers in turn keeps a thousand numbers, not a thousand liveness records
    /// (the simulator's scale run loses a peer on almost every request: its idle
    /// connections close).
    lost: BTreeMap<P, u64>,
    /// Heartbeat seqs, for all peers, so an echo never matches a beat of another connection.
    beat_seq: u64,
}

impl<P: Ord + Clone> PeerTable<P> {
    /// A table that takes a peer silent for longer than `loss_timeout` as lost.
    pub fn new(loss_timeout: Duration) -> Self {
        Self {
            loss_timeout,
            peers: BTreeMap::new(),
            lost: BTreeMap::new(),
            beat_seq: 0,
        }
    }

    /// How long a peer may stay silent before it is lost.
    pub fn loss_timeout(&self) -> Duration {
        self.loss_timeout
    }

    /// The entry of a peer not lost; a new one for a peer never heard of. `None` for a
    /// lost one: it stays lost until [`adopt`](Self::adopt)ed again.
    fn entry(&mut self, peer: &P) -> Option<&mut Liveness> {
        if self.lost.contains_key(peer) {
            return None;
        }
        Some(self.peers.entry(peer.clone()).or_default())
    }

    /// What `incarnation`, announced by `peer`, means; changes nothing (a `Restarted`
    /// peer is lost first, then [`adopt`](Self::adopt)ed).
    pub fn incarnation(&self, peer: &P, incarnation: u64) -> Incarnation {
        if let Some(&old) = self.lost.get(peer) {
            return match incarnation.cmp(&old) {
                std::cmp::Ordering::Less => Incarnation::Stale { current: old },
                std::cmp::Ordering::Equal => Incarnation::Unchanged,
                std::cmp::Ordering::Greater => Incarnation::Back { old },
            };
        }
        match self.peers.get(peer).and_then(|l| l.incarnation) {
            Some(current) if incarnation < current => Incarnation::Stale { current },
            Some(old) if old != incarnation => Incarnation::Restarted { old },
            Some(_) => Incarnation::Unchanged,
            None => Incarnation::First,
        }
    }

    /// Takes `incarnation` as the peer's, live.
    pub fn adopt(&mut self, peer: &P, incarnation: u64) {
        self.lost.remove(peer);
        self.peers.entry(peer.clone()).or_default().incarnation = Some(incarnation);
    }

    /// False for a message stamped with an incarnation the peer no longer has.
    pub fn current(&self, peer: &P, incarnation: u64) -> bool {
        self.known_incarnation(peer)
            .is_none_or(|known| known == incarnation)
    }

    /// The incarnation the peer announced last, if any.
    pub fn known_incarnation(&self, peer: &P) -> Option<u64> {
        match self.peers.get(peer) {
            Some(live) => live.incarnation,
            None => self.lost.get(peer).copied(),
        }
    }

    /// A new connection with the peer, heard `now`, with its new writer's lease. Echoes
    /// of beats sent before it prove nothing about this connection: they are forgotten.
    /// A peer still lost (not [`adopt`](Self::adopt)ed since) gets no lease: it is
    /// revoked at once.
    pub fn connected(&mut self, peer: &P, now: Instant, lease: Arc<Lease>) {
        let Some(entry) = self.entry(peer) else {
            lease.revoke();
            return;
        };
        entry.last_heard = Some(now);
        entry.lease = Some(lease);
        entry.beats.clear();
    }

    /// Anything heard from a connected peer `now` (a lost one stays lost).
    pub fn heard(&mut self, peer: &P, now: Instant) {
        if let Some(entry) = self.peers.get_mut(peer) {
            if let Some(t) = entry.last_heard.as_mut() {
                *t = (*t).max(now);
            }
        }
    }

    /// Peers heard from once, not lost, and silent for longer than the loss timeout at
    /// `now`: to be lost.
    pub fn silent(&self, now: Instant) -> Vec<P> {
        self.peers
            .iter()
            .filter(|(_, l)| {
                l.last_heard
                    .is_some_and(|t| now.saturating_duration_since(t) > self.loss_timeout)
            })
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// Our next heartbeat to the peer, sent `now`: its seq and the seq it echoes (the
    /// peer's latest). Remembered, so its echo extends our lease (not for a lost peer:
    /// it holds no lease to extend, and echoes none).
    pub fn beat(&mut self, peer: &P, now: Instant) -> (u64, u64) {
        self.beat_seq += 1;
        let seq = self.beat_seq;
        // Beaten every interval: look it up before cloning a key for a first beat.
        let entry = match self.peers.get_mut(peer) {
            Some(entry) => entry,
            None => match self.entry(peer) {
                Some(entry) => entry,
                None => return (seq, 0),
            },
        };
        if entry.beats.len() >= BEATS_REMEMBERED {
            entry.beats.pop_front();
        }
        entry.beats.push_back((seq, now));
        (seq, entry.heard_seq)
    }

    /// The peer's heartbeat `seq` (0: an answer, not answered in turn), echoing our beat
    /// `echo` (0: none), stating its loss timeout `lease_for`. An echo of a beat we sent at
    /// `t` proves the peer heard us at or after `t`, so it will not take us as lost before
    /// `t + lease_for`: our lease extends to that. Returns the seq to echo in an answer
    /// owed now (so the peer's proof lags by a round trip, not an interval).
    pub fn heartbeat(&mut self, peer: &P, seq: u64, echo: u64, lease_for: Duration) -> Option<u64> {
        let Some(entry) = self.peers.get_mut(peer) else {
            // A lost peer's beat: nothing of ours to extend; an answer is still owed if
            // it asks (its connection may not know yet).
            return (seq != 0 && self.lost.contains_key(peer)).then_some(seq);
        };
        if echo != 0 {
            while entry.beats.front().is_some_and(|(s, _)| *s < echo) {
                entry.beats.pop_front();
            }
            if let Some((s, sent)) = entry.beats.front().copied() {
                if s == echo {
                    entry.beats.pop_front();
                    if let Some(lease) = &entry.lease {
                        lease.extend_to(sent + lease_for);
                    }
                }
            }
        }
        (seq != 0).then(|| {
            entry.heard_seq = seq;
            seq
        })
    }

    /// The peer is lost: our lease with it is revoked (no write of ours is posted into its
    /// memory from now on), and only its incarnation is kept, marked lost, so its late
    /// messages are known stale. Returns whether the peer was known.
    pub fn lose(&mut self, peer: &P) -> bool {
        let Some(entry) = self.peers.remove(peer) else {
            return self.lost.contains_key(peer);
        };
        if let Some(lease) = &entry.lease {
            lease.revoke();
        }
        if let Some(incarnation) = entry.incarnation {
            self.lost.insert(peer.clone(), incarnation);
        }
        true
    }

    /// Whether the peer's current incarnation was lost.
    pub fn is_lost(&self, peer: &P) -> bool {
        self.lost.contains_key(peer)
    }

    /// Beats remembered for the peer (bounded by [`BEATS_REMEMBERED`]).
    pub fn beats_remembered(&self, peer: &P) -> usize {
        self.peers.get(peer).map_or(0, |l| l.beats.len())
    }
}
