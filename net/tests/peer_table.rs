//! Property tests of the peer table (`handoff_net::peers`): the liveness decisions
//! of the control loop, driven as plain data against a model of what they must be.
//!
//! - An incarnation is `First`, `Unchanged`, `Back` (after a loss) or `Restarted` exactly
//!   as the model says, and a message of any other incarnation than the adopted one is
//!   stale.
//! - A peer is silent exactly when it was heard, is not lost, and has been quiet for longer
//!   than the loss timeout; hearing it again, or losing it, ends that.
//! - Our writer's lease with a peer holds exactly until the latest `sent + lease_for` of
//!   our beats it echoed (never for an echo of a beat we did not send, nor after an echo of
//!   a later beat was processed), and never again once the peer is lost.
//! - Beats remembered per peer stay within `BEATS_REMEMBERED`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_net::peers::{Incarnation, PeerTable, BEATS_REMEMBERED};
use handoff_transport::lease::Lease;
use handoff_transport::RankInfo;
use proptest::prelude::*;

const TIMEOUT: Duration = Duration::from_millis(300);

fn peer(i: u8) -> RankInfo {
    RankInfo::single(format!("E{i}").as_str())
}

#[derive(Clone, Debug)]
enum Op {
    /// A hello (or hello ack) announcing an incarnation: a new connection and lease.
    Hello(u8, u64),
    /// Any message from the peer.
    Heard(u8),
    /// Time passes (ms).
    Wait(u64),
    /// The heartbeat tick: silent peers are lost.
    Tick,
    /// Our beat to the peer.
    Beat(u8),
    /// The peer's heartbeat echoing the `n`-th latest beat we sent it (or a seq we never
    /// sent), with its loss timeout in ms.
    Echo(u8, Option<usize>, u64),
    /// Lost for another reason (connection closed, dial failed).
    Lose(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let p = 0u8..3;
    prop_oneof![
        (p.clone(), 1u64..4).prop_map(|(p, i)| Op::Hello(p, i)),
        p.clone().prop_map(Op::Heard),
        (0u64..400).prop_map(Op::Wait),
        Just(Op::Tick),
        p.clone().prop_map(Op::Beat),
        (p.clone(), prop::option::of(0usize..4), 1u64..1000)
            .prop_map(|(p, n, l)| Op::Echo(p, n, l)),
        p.prop_map(Op::Lose),
    ]
}

/// What the table must know of one peer.
#[derive(Default)]
struct Model {
    incarnation: Option<u64>,
    lost: bool,
    last_heard: Option<Instant>,
    /// Our beats since the last connection not yet done with, `(seq, sent)`, in order,
    /// the latest `BEATS_REMEMBERED`: an echo is done with every beat up to its own.
    beats: Vec<(u64, Instant)>,
    lease: Option<Arc<Lease>>,
    /// The lease holds before this (`None`: never extended).
    lease_until: Option<Instant>,
    revoked: bool,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(handoff_testkit::proptest_cases(1000)))]

    #[test]
    fn the_peer_table_decides_as_the_model_says(ops in prop::collection::vec(op(), 0..60)) {
        let start = Instant::now();
        let mut now = start;
        let mut table = PeerTable::new(TIMEOUT);
        let mut model: BTreeMap<u8, Model> = BTreeMap::new();
        let mut sent_seqs = 0u64;
        for op in ops {
            match op {
                Op::Hello(p, inc) => {
                    let m = model.entry(p).or_default();
                    let verdict = table.incarnation(&peer(p), inc);
                    let expect = match m.incarnation {
                        None => Incarnation::First,
                        Some(old) if old == inc => Incarnation::Unchanged,
                        Some(current) if inc < current => Incarnation::Stale { current },
                        Some(old) if m.lost => Incarnation::Back { old },
                        Some(old) => Incarnation::Restarted { old },
                    };
                    prop_assert_eq!(verdict, expect);
                    if let Incarnation::Stale { .. } = verdict {
                        // Refused: an older process than the one we know.
                        continue;
                    }
                    if let Incarnation::Restarted { .. } = verdict {
                        table.lose(&peer(p));
                        if let Some(l) = &m.lease {
                            prop_assert!(l.is_revoked(), "a restarted peer's lease still holds");
                        }
                    }
                    table.adopt(&peer(p), inc);
                    let lease = Arc::new(Lease::new());
                    table.connected(&peer(p), now, lease.clone());
                    *m = Model {
                        incarnation: Some(inc),
                        lost: false,
                        last_heard: Some(now),
                        lease: Some(lease),
                        ..Model::default()
                    };
                }
                Op::Heard(p) => {
                    table.heard(&peer(p), now);
                    if let Some(m) = model.get_mut(&p) {
                        if !m.lost && m.last_heard.is_some() {
                            m.last_heard = Some(now);
                        }
                    }
                }
                Op::Wait(ms) => now += Duration::from_millis(ms),
                Op::Tick => {
                    let silent = table.silent(now);
                    let expect: Vec<RankInfo> = model
                        .iter()
                        .filter(|(_, m)| {
                            !m.lost && m.last_heard.is_some_and(|t| now.duration_since(t) > TIMEOUT)
                        })
                        .map(|(p, _)| peer(*p))
                        .collect();
                    prop_assert_eq!(&silent, &expect);
                    for r in silent {
                        table.lose(&r);
                        let p = model.iter().find(|(p, _)| peer(**p) == r).map(|(p, _)| *p).unwrap();
                        lost(model.get_mut(&p).unwrap());
                    }
                }
                Op::Beat(p) => {
                    let (seq, _) = table.beat(&peer(p), now);
                    sent_seqs += 1;
                    prop_assert_eq!(seq, sent_seqs, "seqs are process-wide and increasing");
                    let m = model.entry(p).or_default();
                    if m.beats.len() >= BEATS_REMEMBERED {
                        m.beats.remove(0);
                    }
                    m.beats.push((seq, now));
                    prop_assert!(table.beats_remembered(&peer(p)) <= BEATS_REMEMBERED);
                }
                Op::Echo(p, n, lease_ms) => {
                    let lease_for = Duration::from_millis(lease_ms);
                    let m = model.entry(p).or_default();
                    // The n-th latest beat we sent this peer, or one we never sent.
                    let echo = match n {
                        Some(n) if n < m.beats.len() => m.beats[m.beats.len() - 1 - n].0,
                        _ => sent_seqs + 1_000,
                    };
                    table.heartbeat(&peer(p), 7, echo, lease_for);
                    let hit = m.beats.iter().find(|(s, _)| *s == echo).copied();
                    // Beats up to the echo are done with, whether or not it matched one.
                    m.beats.retain(|(s, _)| *s > echo);
                    if let (Some((_, sent)), false) = (hit, m.lost) {
                        if m.lease.is_some() {
                            let until = sent + lease_for;
                            m.lease_until = Some(m.lease_until.map_or(until, |u| u.max(until)));
                        }
                    }
                }
                Op::Lose(p) => {
                    table.lose(&peer(p));
                    if let Some(m) = model.get_mut(&p) {
                        lost(m);
                    }
                }
            }
            // After every step: staleness, and every lease exactly as the model says.
            for (p, m) in &model {
                prop_assert_eq!(table.is_lost(&peer(*p)), m.lost && m.incarnation.is_some());
                for inc in 1..4 {
                    let fresh = m.incarnation.is_none_or(|k| k == inc);
                    prop_assert_eq!(table.current(&peer(*p), inc), fresh);
                }
                if let Some(lease) = &m.lease {
                    let holds = !m.revoked && m.lease_until.is_some_and(|u| now < u);
                    prop_assert_eq!(lease.holds_at(now), holds, "peer {}", p);
                }
            }
        }
    }
}

/// The model of losing a peer: the lease revoked, only the incarnation kept, marked lost.
fn lost(m: &mut Model) {
    m.revoked = true;
    m.last_heard = None;
    m.beats.clear();
    if m.incarnation.is_some() {
        m.lost = true;
    }
}

/// A lost peer keeps only its incarnation: a connection reported for it before it is
/// adopted again gets no lease (revoked at once), our beats to it are not remembered, and
/// its late messages of the lost incarnation stay recognised; adopting it makes it live.
#[test]
fn a_lost_peer_keeps_its_incarnation_and_nothing_that_could_extend_a_lease() {
    let now = Instant::now();
    let mut table = PeerTable::new(TIMEOUT);
    let p = peer(1);
    table.adopt(&p, 5);
    table.connected(&p, now, Arc::new(Lease::new()));
    assert!(table.lose(&p));
    assert!(table.is_lost(&p));
    assert_eq!(table.known_incarnation(&p), Some(5));
    assert_eq!(table.incarnation(&p, 5), Incarnation::Unchanged);
    assert_eq!(table.incarnation(&p, 6), Incarnation::Back { old: 5 });

    let lease = Arc::new(Lease::new());
    lease.extend_to(now + TIMEOUT);
    table.connected(&p, now, lease.clone());
    assert!(lease.is_revoked(), "a lost peer's connection got a lease");
    let (seq, echo) = table.beat(&p, now);
    assert_eq!(echo, 0);
    assert_eq!(table.beats_remembered(&p), 0);
    assert_eq!(
        table.heartbeat(&p, 9, seq, TIMEOUT),
        Some(9),
        "its beat is answered"
    );
    assert!(table.lose(&p), "losing it again: still known");
    assert!(table.is_lost(&p));

    table.adopt(&p, 6);
    assert!(!table.is_lost(&p));
    assert_eq!(table.known_incarnation(&p), Some(6));
    let lease = Arc::new(Lease::new());
    table.connected(&p, now, lease.clone());
    let (seq, _) = table.beat(&p, now);
    assert_eq!(table.beats_remembered(&p), 1);
    table.heartbeat(&p, 0, seq, TIMEOUT);
    assert!(
        lease.holds_at(now),
        "the adopted peer's echo extends its lease"
    );
}
