//! The machines' main paths, action by action: what each side sends, when it moves bytes,
//! and when it lets go of its blocks.

use std::time::{Duration, Instant};

use handoff_actors::machine::{
    Action, PeerMessage, ReceiverEvent, ReceiverMachine, SenderEvent, SenderMachine, State,
    Timeouts, QUARANTINE_ASK_EVERY,
};
use handoff_actors::{FenceEnd, ReleaseReason};
use handoff_transport::{BlockId, FailureReason, RankInfo, TransferMode};

fn b(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().copied().map(BlockId).collect()
}

fn rank(engine: &str, pp: u32) -> RankInfo {
    let mut r = RankInfo::single(engine);
    r.pp_rank = pp;
    r.pp_size = 2;
    r
}

fn drain_s(m: &mut SenderMachine) -> Vec<Action> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

/// A push receiver over a one-sided plane (its failures fence writes), with `peers` resolved
/// and blocks 4 and 5 allocated: its transfer info is out to every one of them.
fn pushing(t: Instant, timeouts: Timeouts, peers: &[&RankInfo]) -> ReceiverMachine {
    let mut m = ReceiverMachine::new(t, timeouts, TransferMode::Push).fence_writes(true);
    let peers = peers.iter().map(|p| (*p).clone()).collect();
    m.handle(
        t,
        ReceiverEvent::PeersResolved {
            peers,
            unwatched: vec![],
        },
    );
    m.handle(t, ReceiverEvent::Allocated { blocks: b(&[4, 5]) });
    m
}

fn drain_r(m: &mut ReceiverMachine) -> Vec<Action> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

fn changed(s: State) -> Action {
    Action::StateChanged(s)
}

fn released(ids: &[u32], why: ReleaseReason) -> Action {
    Action::Release {
        blocks: b(ids),
        why,
    }
}

fn failed(reason: FailureReason, fence: Option<FenceEnd>) -> ReleaseReason {
    ReleaseReason::Failed { reason, fence }
}

#[test]
fn sender_push_writes_then_says_done_then_releases() {
    let t = Instant::now();
    let d = rank("D", 0);
    let mut m = SenderMachine::new(t, Timeouts::default());
    m.handle(
        t,
        SenderEvent::TransferInfo {
            from: d.clone(),
            mode: TransferMode::Push,
            blocks: b(&[7, 8]),
        },
    );
    assert_eq!(drain_s(&mut m), vec![changed(State::WaitingForInput)]);
    m.handle(
        t,
        SenderEvent::Input {
            blocks: b(&[1, 2]),
            aux: vec![],
        },
    );
    assert_eq!(
        drain_s(&mut m),
        vec![
            changed(State::Transferring),
            Action::Write {
                to: d.clone(),
                src: b(&[1, 2]),
                dst: b(&[7, 8]),
                // The state's deadline, decided by the machine, is the write's.
                deadline: t + Timeouts::default().transfer,
            }
        ]
    );
    m.handle(t, SenderEvent::TransferComplete { to: d.clone() });
    assert_eq!(
        drain_s(&mut m),
        vec![
            Action::Send {
                to: d,
                msg: PeerMessage::Done { aux: vec![] }
            },
            changed(State::Done),
            released(&[1, 2], ReleaseReason::Done)
        ]
    );
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn sender_given_blocks_before_transfer_info_goes_straight_to_transferring() {
    let t = Instant::now();
    let d = rank("D", 0);
    let mut m = SenderMachine::new(t, Timeouts::default());
    m.handle(
        t,
        SenderEvent::Input {
            blocks: b(&[1]),
            aux: vec![],
        },
    );
    assert_eq!(drain_s(&mut m), vec![]);
    assert_eq!(m.state(), &State::Bootstrapping);
    m.handle(
        t,
        SenderEvent::TransferInfo {
            from: d.clone(),
            mode: TransferMode::Pull,
            blocks: b(&[9]),
        },
    );
    assert_eq!(
        drain_s(&mut m),
        vec![
            changed(State::Transferring),
            Action::Send {
                to: d.clone(),
                msg: PeerMessage::Ready {
                    blocks: b(&[1]),
                    aux: vec![],
                    hold: Timeouts::default().pull_ttl,
                }
            }
        ]
    );
    // Pull: the TTL, not the transfer timeout, bounds how long the blocks are held.
    assert_eq!(m.poll_timeout(), Some(t + Timeouts::default().pull_ttl));
    m.handle(t, SenderEvent::ReadDone { from: d });
    assert_eq!(
        drain_s(&mut m),
        vec![changed(State::Done), released(&[1], ReleaseReason::Done)]
    );
}

#[test]
fn sender_refuses_a_block_count_mismatch_and_tells_decode() {
    let t = Instant::now();
    let d = rank("D", 0);
    let mut m = SenderMachine::new(t, Timeouts::default());
    m.handle(
        t,
        SenderEvent::TransferInfo {
            from: d.clone(),
            mode: TransferMode::Push,
            blocks: b(&[7]),
        },
    );
    m.handle(
        t,
        SenderEvent::Input {
            blocks: b(&[1, 2]),
            aux: vec![],
        },
    );
    let actions = drain_s(&mut m);
    assert!(
        matches!(m.state(), State::Failed(FailureReason::Protocol { detail }) if detail.contains("granted 1 blocks"))
    );
    assert!(actions.iter().any(|a| matches!(
        a,
        Action::Send {
            msg: PeerMessage::Abort { .. },
            ..
        }
    )));
    assert!(actions.iter().any(|a| matches!(
        a,
        Action::Release { blocks, why: ReleaseReason::Failed { reason: FailureReason::Protocol { .. }, fence: None } }
            if *blocks == b(&[1, 2])
    )));
    // No write was started, so decode's fence can lift at once.
    assert_eq!(
        actions.last(),
        Some(&Action::Send {
            to: d,
            msg: PeerMessage::AbortAck
        })
    );
    assert!(m.is_settled());
}

#[test]
fn sender_that_was_told_queued_aborts_that_decode_when_bootstrap_times_out() {
    let t = Instant::now();
    let d = rank("D", 0);
    let timeouts = Timeouts::default();
    let mut m = SenderMachine::new(t, timeouts);
    m.handle(t, SenderEvent::Queued { from: d.clone() });
    m.handle_timeout(t + timeouts.bootstrap - Duration::from_millis(1));
    assert_eq!(m.state(), &State::Bootstrapping, "not before the deadline");
    m.handle_timeout(t + timeouts.bootstrap);
    let reason = FailureReason::BootstrapTimeout;
    assert_eq!(
        drain_s(&mut m),
        vec![
            Action::Send {
                to: d,
                msg: PeerMessage::Abort {
                    reason: reason.clone()
                }
            },
            changed(State::Failed(reason.clone())),
            released(&[], failed(reason, None))
        ]
    );
}

#[test]
fn receiver_push_waits_for_done_from_every_pipeline_rank() {
    let t = Instant::now();
    let (p0, p1) = (rank("P", 0), rank("P", 1));
    let mut m = ReceiverMachine::new(t, Timeouts::default(), TransferMode::Push);
    m.handle(
        t,
        ReceiverEvent::PeersResolved {
            peers: vec![p0.clone(), p1.clone()],
            unwatched: vec![],
        },
    );
    assert_eq!(
        drain_r(&mut m),
        vec![
            Action::Send {
                to: p0.clone(),
                msg: PeerMessage::Queued
            },
            Action::Send {
                to: p1.clone(),
                msg: PeerMessage::Queued
            }
        ],
        "peers known but no blocks: tell prefill we live"
    );
    m.handle(t, ReceiverEvent::Allocated { blocks: b(&[4, 5]) });
    let info = PeerMessage::TransferInfo {
        mode: TransferMode::Push,
        blocks: b(&[4, 5]),
    };
    assert_eq!(
        drain_r(&mut m),
        vec![
            Action::Send {
                to: p0.clone(),
                msg: info.clone()
            },
            Action::Send {
                to: p1.clone(),
                msg: info
            },
            changed(State::WaitingForInput)
        ]
    );
    m.handle(
        t,
        ReceiverEvent::Done {
            from: p1.clone(),
            aux: vec![],
        },
    );
    assert_eq!(drain_r(&mut m), vec![changed(State::Transferring)]);
    m.handle(
        t,
        ReceiverEvent::Done {
            from: p1,
            aux: vec![],
        },
    );
    assert_eq!(drain_r(&mut m), vec![], "a duplicate Done changes nothing");
    m.handle(
        t,
        ReceiverEvent::Done {
            from: p0,
            aux: vec![],
        },
    );
    assert_eq!(
        drain_r(&mut m),
        vec![changed(State::Done), released(&[4, 5], ReleaseReason::Done)]
    );
}

#[test]
fn receiver_pull_reads_then_acknowledges_each_rank() {
    let t = Instant::now();
    let p0 = rank("P", 0);
    let mut m = ReceiverMachine::new(t, Timeouts::default(), TransferMode::Pull);
    m.handle(t, ReceiverEvent::Allocated { blocks: b(&[4]) });
    m.handle(
        t,
        ReceiverEvent::PeersResolved {
            peers: vec![p0.clone()],
            unwatched: vec![],
        },
    );
    drain_r(&mut m);
    m.handle(
        t,
        ReceiverEvent::Ready {
            from: p0.clone(),
            blocks: b(&[9]),
            aux: vec![],
            hold: Timeouts::default().pull_ttl,
        },
    );
    assert_eq!(
        drain_r(&mut m),
        vec![
            changed(State::Transferring),
            Action::Read {
                from: p0.clone(),
                src: b(&[9]),
                dst: b(&[4]),
                // The transfer deadline comes before the end of prefill's hold.
                deadline: t + Timeouts::default().transfer,
            }
        ]
    );
    m.handle(t, ReceiverEvent::ReadComplete { from: p0.clone() });
    assert_eq!(
        drain_r(&mut m),
        vec![
            Action::Send {
                to: p0,
                msg: PeerMessage::ReadDone
            },
            changed(State::Done),
            released(&[4], ReleaseReason::Done)
        ]
    );
}

#[test]
fn receiver_names_a_stranger_and_a_wrong_mode_as_protocol_errors() {
    let t = Instant::now();
    let p0 = rank("P", 0);
    for (event, expect) in [
        (
            ReceiverEvent::Done {
                from: rank("X", 0),
                aux: vec![],
            },
            "from a rank not serving this request",
        ),
        (
            ReceiverEvent::Ready {
                from: p0.clone(),
                blocks: b(&[1]),
                aux: vec![],
                hold: Timeouts::default().pull_ttl,
            },
            "Ready in Push mode",
        ),
    ] {
        let mut m = ReceiverMachine::new(t, Timeouts::default(), TransferMode::Push);
        m.handle(
            t,
            ReceiverEvent::PeersResolved {
                peers: vec![p0.clone()],
                unwatched: vec![],
            },
        );
        m.handle(t, ReceiverEvent::Allocated { blocks: b(&[1]) });
        m.handle(t, event);
        let State::Failed(FailureReason::Protocol { detail }) = m.state() else {
            panic!("expected a protocol error, got {}", m.state());
        };
        assert!(detail.contains(expect), "{detail}");
    }
}

#[test]
fn a_failed_push_receiver_holds_its_blocks_until_prefill_acknowledges() {
    let t = Instant::now();
    let (p0, p1) = (rank("P", 0), rank("P", 1));
    let timeouts = Timeouts::default();
    let mut m = pushing(t, timeouts, &[&p0, &p1]);
    m.handle(
        t,
        ReceiverEvent::Done {
            from: p1.clone(),
            aux: vec![],
        },
    ); // p1's writes are complete
    drain_r(&mut m);
    m.handle_timeout(t + timeouts.transfer); // transferring since p1's Done
    assert_eq!(
        drain_r(&mut m),
        vec![
            Action::Send {
                to: p0.clone(),
                msg: PeerMessage::Abort {
                    reason: FailureReason::TransferTimeout
                }
            },
            changed(State::Failed(FailureReason::TransferTimeout))
        ],
        "failed, but the blocks stay: p0 may still be writing"
    );
    assert!(!m.is_settled());
    m.handle(t, ReceiverEvent::AbortAck { from: p1 });
    assert_eq!(
        drain_r(&mut m),
        vec![],
        "p1 already finished; p0 is the one fenced"
    );
    m.handle(t, ReceiverEvent::AbortAck { from: p0 });
    assert_eq!(
        drain_r(&mut m),
        vec![released(
            &[4, 5],
            failed(FailureReason::TransferTimeout, Some(FenceEnd::Confirmed))
        )]
    );
    assert!(m.is_settled());
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn a_fence_without_acknowledgement_lifts_at_its_deadline() {
    let t = Instant::now();
    let p0 = rank("P", 0);
    let timeouts = Timeouts::default();
    let mut m = ReceiverMachine::new(t, timeouts, TransferMode::Push).fence_writes(true);
    m.handle(
        t,
        ReceiverEvent::PeersResolved {
            peers: vec![p0.clone()],
            unwatched: vec![],
        },
    );
    m.handle(t, ReceiverEvent::Allocated { blocks: b(&[4]) });
    m.handle(t, ReceiverEvent::Abort);
    drain_r(&mut m);
    assert_eq!(m.poll_timeout(), Some(t + timeouts.fence_max()));
    m.handle_timeout(t + timeouts.fence_max() - Duration::from_millis(1));
    assert_eq!(drain_r(&mut m), vec![]);
    m.handle_timeout(t + timeouts.fence_max());
    assert_eq!(
        drain_r(&mut m),
        vec![released(
            &[4],
            failed(FailureReason::AbortedByEngine, Some(FenceEnd::Bound))
        )]
    );
    assert!(m.is_settled());
}

/// A writer lost past the fence bound may be one stopped between its lease check and a
/// post: no time bound covers that, so its blocks are quarantined (no deadline) until the
/// driver sees it exit or it confirms; a live rank that never confirmed is let go then.
#[test]
fn a_lost_writer_keeps_its_blocks_quarantined_past_the_fence_bound() {
    let t = Instant::now();
    let (p0, p1) = (rank("P", 0), rank("P", 1));
    let timeouts = Timeouts::default();
    let start = |m: &mut ReceiverMachine| {
        m.handle(
            t,
            ReceiverEvent::PeersResolved {
                peers: vec![p0.clone(), p1.clone()],
                unwatched: vec![],
            },
        );
        m.handle(t, ReceiverEvent::Allocated { blocks: b(&[4, 5]) });
        m.handle(t, ReceiverEvent::PeerLost { peer: p0.clone() });
        drain_r(m);
        m.handle_timeout(t + timeouts.fence_max());
    };
    let lost = |why: FenceEnd| {
        released(
            &[4, 5],
            failed(
                FailureReason::PeerLost {
                    peer: p0.to_string(),
                },
                Some(why),
            ),
        )
    };
    // Its process exits: the blocks go.
    let mut m = ReceiverMachine::new(t, timeouts, TransferMode::Push).fence_writes(true);
    start(&mut m);
    assert_eq!(
        drain_r(&mut m),
        vec![Action::Quarantine {
            peers: vec![p0.clone()],
            blocks: 2,
            replaced: vec![],
        }]
    );
    // No time bound: each deadline only asks the lost writer again, in case its
    // acknowledgement was lost with its connection.
    let mut at = t + timeouts.fence_max();
    for _ in 0..3 {
        let ask = m.poll_timeout().expect("asks again later");
        assert_eq!(ask, at + QUARANTINE_ASK_EVERY);
        m.handle_timeout(ask);
        assert_eq!(
            drain_r(&mut m),
            vec![Action::Send {
                to: p0.clone(),
                msg: PeerMessage::Abort {
                    reason: FailureReason::PeerLost {
                        peer: p0.to_string()
                    }
                }
            }]
        );
        assert!(!m.is_settled());
        at = ask;
    }
    m.handle(
        t,
        ReceiverEvent::WriterGone {
            peer: p1.clone(),
            exited: true,
        },
    );
    assert_eq!(drain_r(&mut m), vec![], "p1 was not what it waits for");
    m.handle(
        t,
        ReceiverEvent::WriterGone {
            peer: p0.clone(),
            exited: true,
        },
    );
    assert_eq!(drain_r(&mut m), vec![lost(FenceEnd::Confirmed)]);
    assert!(m.is_settled());
    // It comes back and confirms.
    let mut m = ReceiverMachine::new(t, timeouts, TransferMode::Push).fence_writes(true);
    start(&mut m);
    drain_r(&mut m);
    m.handle(t, ReceiverEvent::AbortAck { from: p0.clone() });
    assert_eq!(drain_r(&mut m), vec![lost(FenceEnd::Confirmed)]);
    // Its driver cannot watch it (another host): the bound is all there is.
    let mut m = ReceiverMachine::new(t, timeouts, TransferMode::Push).fence_writes(true);
    start(&mut m);
    drain_r(&mut m);
    m.handle(
        t,
        ReceiverEvent::WriterGone {
            peer: p0.clone(),
            exited: false,
        },
    );
    assert_eq!(drain_r(&mut m), vec![lost(FenceEnd::Bound)]);
    // A plane that checks every write on arrival fences nothing.
    let mut m = ReceiverMachine::new(t, timeouts, TransferMode::Push);
    start(&mut m);
    assert!(m.is_settled());
}

/// A lost writer's rank taken by a new process (a restart while the old one is stopped):
/// the new one answers an abort for a request it never knew with `AbortAck`, which speaks
/// for it alone. Neither the fence nor the quarantine ends on it, the new process is not
/// asked, and only the old one's end lets the blocks go. A rank replaced before it was lost
/// here (it held none of our grants then) confirms as before.
#[test]
fn a_new_process_in_a_lost_writers_rank_ends_neither_fence_nor_quarantine() {
    let t = Instant::now();
    let (p0, p1) = (rank("P", 0), rank("P", 1));
    let timeouts = Timeouts::default();
    let mut m = pushing(t, timeouts, &[&p0, &p1]);
    // p1 restarted before anything was lost: nothing changes for it.
    m.handle(t, ReceiverEvent::WriterReplaced { peer: p1.clone() });
    m.handle(t, ReceiverEvent::PeerLost { peer: p0.clone() });
    drain_r(&mut m);
    m.handle(t, ReceiverEvent::AbortAck { from: p1.clone() });
    assert_eq!(drain_r(&mut m), vec![], "p0 still fences");
    // p0's rank, lost, is taken by a new process, which answers for itself.
    m.handle(t, ReceiverEvent::WriterReplaced { peer: p0.clone() });
    m.handle(t, ReceiverEvent::AbortAck { from: p0.clone() });
    m.handle(
        t,
        ReceiverEvent::Done {
            from: p0.clone(),
            aux: vec![],
        },
    );
    let refused = Action::Unconfirmed { from: p0.clone() };
    assert_eq!(drain_r(&mut m), vec![refused.clone(), refused.clone()]);
    assert!(!m.is_settled());
    // The bound: quarantined, and never asked (the new process would only answer).
    m.handle_timeout(t + timeouts.fence_max());
    assert_eq!(
        drain_r(&mut m),
        vec![Action::Quarantine {
            peers: vec![p0.clone()],
            blocks: 2,
            replaced: vec![p0.clone()],
        }]
    );
    let ask = m.poll_timeout().expect("a quarantine's deadline");
    m.handle_timeout(ask);
    assert_eq!(drain_r(&mut m), vec![], "a replaced writer is not asked");
    m.handle(ask, ReceiverEvent::AbortAck { from: p0.clone() });
    assert_eq!(drain_r(&mut m), vec![refused]);
    assert!(!m.is_settled());
    // The old process exits.
    m.handle(
        ask,
        ReceiverEvent::WriterGone {
            peer: p0.clone(),
            exited: true,
        },
    );
    let reason = FailureReason::PeerLost {
        peer: p0.to_string(),
    };
    let end = released(&[4, 5], failed(reason, Some(FenceEnd::Confirmed)));
    assert_eq!(drain_r(&mut m), vec![end.clone()]);
    assert!(m.is_settled());
    // Replaced once the quarantine holds: its watch may have found the new process, so
    // the rank's earlier ones are watched too; the new one's answer still ends nothing.
    let mut m = pushing(t, timeouts, &[&p0]);
    m.handle(t, ReceiverEvent::PeerLost { peer: p0.clone() });
    m.handle_timeout(t + timeouts.fence_max());
    drain_r(&mut m);
    m.handle(t, ReceiverEvent::WriterReplaced { peer: p0.clone() });
    m.handle(t, ReceiverEvent::AbortAck { from: p0.clone() });
    assert_eq!(
        drain_r(&mut m),
        vec![
            Action::WatchEarlier { peer: p0.clone() },
            Action::Unconfirmed { from: p0.clone() }
        ]
    );
    m.handle(
        t,
        ReceiverEvent::WriterGone {
            peer: p0.clone(),
            exited: true,
        },
    );
    assert_eq!(drain_r(&mut m), vec![end]);
}

#[test]
fn a_prefill_rank_acknowledges_only_after_its_write_reported_back() {
    let t = Instant::now();
    let d = rank("D", 0);
    let mut m = SenderMachine::new(t, Timeouts::default());
    m.handle(
        t,
        SenderEvent::TransferInfo {
            from: d.clone(),
            mode: TransferMode::Push,
            blocks: b(&[7]),
        },
    );
    m.handle(
        t,
        SenderEvent::Input {
            blocks: b(&[1]),
            aux: vec![],
        },
    );
    drain_s(&mut m); // the write is posted
    m.handle(
        t,
        SenderEvent::PeerAbort {
            from: d.clone(),
            reason: FailureReason::AbortedByEngine,
        },
    );
    let actions = drain_s(&mut m);
    assert!(
        !actions.iter().any(|a| matches!(
            a,
            Action::Send {
                msg: PeerMessage::AbortAck,
                ..
            }
        )),
        "acked with a write in flight: {actions:?}"
    );
    assert!(!m.is_settled());
    m.handle(
        t,
        SenderEvent::TransferFailed {
            to: d.clone(),
            detail: "cancelled".into(),
        },
    );
    assert_eq!(
        drain_s(&mut m),
        vec![Action::Send {
            to: d,
            msg: PeerMessage::AbortAck
        }]
    );
    assert!(m.is_settled());
}

/// The first message from decode is invalid (say, transfer info naming a region prefill
/// cannot use): prefill fails, and tells that decode rank, which would otherwise wait out
/// its whole deadline for a partner that has already given up.
#[test]
fn sender_failed_by_an_unpaired_peers_invalid_message_tells_that_peer() {
    let t = Instant::now();
    let d = rank("D", 0);
    let mut m = SenderMachine::new(t, Timeouts::default());
    m.handle(
        t,
        SenderEvent::Unexpected {
            from: d.clone(),
            what: "invalid message: peer blocks are 8 bytes, ours 4".into(),
        },
    );
    let actions = drain_s(&mut m);
    assert!(
        actions.iter().any(|a| matches!(
            a,
            Action::Send { to, msg: PeerMessage::Abort { reason: FailureReason::Protocol { .. } } } if *to == d
        )),
        "{actions:?}"
    );
    assert!(
        actions.iter().any(|a| matches!(
            a,
            Action::StateChanged(State::Failed(FailureReason::Protocol { .. }))
        )),
        "{actions:?}"
    );
}

#[test]
fn the_engines_payload_travels_with_done_or_ready_and_reaches_decode_before_done() {
    let t = Instant::now();
    let d = rank("D", 0);
    let p = rank("P", 0);
    let aux = b"first token".to_vec();
    for mode in [TransferMode::Push, TransferMode::Pull] {
        // Prefill: the payload handed over with the blocks goes out with the last message.
        let mut s = SenderMachine::new(t, Timeouts::default());
        s.handle(
            t,
            SenderEvent::Input {
                blocks: b(&[1]),
                aux: aux.clone(),
            },
        );
        s.handle(
            t,
            SenderEvent::TransferInfo {
                from: d.clone(),
                mode,
                blocks: b(&[9]),
            },
        );
        if mode == TransferMode::Push {
            s.handle(t, SenderEvent::TransferComplete { to: d.clone() });
        }
        let sent: Vec<PeerMessage> = drain_s(&mut s)
            .into_iter()
            .filter_map(|a| match a {
                Action::Send { msg, .. } => Some(msg),
                _ => None,
            })
            .collect();
        let expected = match mode {
            TransferMode::Push => PeerMessage::Done { aux: aux.clone() },
            TransferMode::Pull => PeerMessage::Ready {
                blocks: b(&[1]),
                aux: aux.clone(),
                hold: Timeouts::default().pull_ttl,
            },
        };
        assert_eq!(sent, vec![expected], "{mode:?}");

        // Decode: the payload is handed to the driver before the request is Done.
        let mut r = ReceiverMachine::new(t, Timeouts::default(), mode);
        r.handle(t, ReceiverEvent::Allocated { blocks: b(&[9]) });
        r.handle(
            t,
            ReceiverEvent::PeersResolved {
                peers: vec![p.clone()],
                unwatched: vec![],
            },
        );
        drain_r(&mut r);
        match mode {
            TransferMode::Push => r.handle(
                t,
                ReceiverEvent::Done {
                    from: p.clone(),
                    aux: aux.clone(),
                },
            ),
            TransferMode::Pull => {
                r.handle(
                    t,
                    ReceiverEvent::Ready {
                        from: p.clone(),
                        blocks: b(&[1]),
                        aux: aux.clone(),
                        hold: Timeouts::default().pull_ttl,
                    },
                );
                r.handle(t, ReceiverEvent::ReadComplete { from: p.clone() });
            }
        }
        let actions = drain_r(&mut r);
        let at_aux = actions
            .iter()
            .position(|a| matches!(a, Action::Aux { from, bytes } if *from == p && *bytes == aux));
        let at_done = actions.iter().position(|a| *a == changed(State::Done));
        assert!(
            matches!((at_aux, at_done), (Some(x), Some(y)) if x < y),
            "{mode:?}: {actions:?}"
        );
    }
}

/// Pull: a read that completes after prefill's stated hold, counted from when our transfer
/// info went out (we were frozen, or the read stalled), may have read blocks prefill gave
/// back and reused: it fails `TtlExpired` and never says `ReadDone` or `Done`; prefill is
/// told and acknowledged so it can let go. A read just inside the hold is `Done`.
#[test]
fn a_pull_read_that_finishes_after_prefills_hold_fails_instead_of_done() {
    let hold = Duration::from_secs(5);
    for (late, expect_done) in [
        (Duration::from_millis(4_900), true),
        (Duration::from_millis(5_001), false),
    ] {
        let t = Instant::now();
        let p0 = rank("P", 0);
        let mut m = ReceiverMachine::new(t, Timeouts::default(), TransferMode::Pull);
        m.handle(t, ReceiverEvent::Allocated { blocks: b(&[4]) });
        m.handle(
            t,
            ReceiverEvent::PeersResolved {
                peers: vec![p0.clone()],
                unwatched: vec![],
            },
        );
        drain_r(&mut m);
        // Prefill's hold starts when it sends Ready, a second after our info left.
        let ready_at = t + Duration::from_secs(1);
        m.handle(
            ready_at,
            ReceiverEvent::Ready {
                from: p0.clone(),
                blocks: b(&[9]),
                aux: vec![],
                hold,
            },
        );
        drain_r(&mut m);
        m.handle(t + late, ReceiverEvent::ReadComplete { from: p0.clone() });
        let actions = drain_r(&mut m);
        let sent: Vec<&PeerMessage> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Send { msg, .. } => Some(msg),
                _ => None,
            })
            .collect();
        if expect_done {
            assert_eq!(sent, vec![&PeerMessage::ReadDone], "{late:?}");
            assert!(
                actions.contains(&changed(State::Done)),
                "{late:?}: {actions:?}"
            );
        } else {
            assert!(
                !sent.contains(&&PeerMessage::ReadDone),
                "{late:?}: {actions:?}"
            );
            assert!(
                sent.iter().any(|m| matches!(m, PeerMessage::Abort { .. })),
                "{actions:?}"
            );
            assert!(sent.contains(&&PeerMessage::AbortAck), "{actions:?}");
            assert!(
                actions.contains(&changed(State::Failed(FailureReason::TtlExpired))),
                "{late:?}: {actions:?}"
            );
        }
        assert!(
            actions.iter().any(|a| matches!(a, Action::Release { .. })),
            "{late:?}: the blocks go back to the engine either way: {actions:?}"
        );
    }
}

/// One deadline per transfer, decided by the machine: a read's is the end of prefill's
/// hold (counted from when our transfer info went out) when that comes before the
/// request's transfer deadline, so the plane posts no read past the hold.
#[test]
fn a_reads_deadline_is_the_end_of_prefills_hold_when_that_comes_first() {
    let t = Instant::now();
    let p0 = rank("P", 0);
    for (hold, expect) in [
        (Duration::from_secs(5), t + Duration::from_secs(5)),
        (
            Duration::from_secs(600),
            t + Duration::from_secs(1) + Timeouts::default().transfer,
        ),
    ] {
        let deadline = ready_after(t, &p0, Duration::from_secs(1), hold)
            .into_iter()
            .find_map(|a| match a {
                Action::Read { deadline, .. } => Some(deadline),
                _ => None,
            });
        assert_eq!(deadline, Some(expect), "hold {hold:?}");
    }
}

/// A `Ready` that arrives after prefill's hold has already run out (counted from our
/// transfer info) posts no read: the request fails `TtlExpired` and prefill is told and
/// acknowledged, so it can let its blocks go.
#[test]
fn a_ready_that_arrives_after_its_hold_posts_no_read() {
    let t = Instant::now();
    let p0 = rank("P", 0);
    let actions = ready_after(t, &p0, Duration::from_secs(6), Duration::from_secs(5));
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Read { .. })),
        "{actions:?}"
    );
    assert!(
        actions.contains(&changed(State::Failed(FailureReason::TtlExpired))),
        "{actions:?}"
    );
    assert!(
        actions.contains(&Action::Send {
            to: p0.clone(),
            msg: PeerMessage::AbortAck
        }),
        "{actions:?}"
    );
    assert!(
        actions.iter().any(|a| matches!(a, Action::Release { .. })),
        "{actions:?}"
    );
}

/// A pull receiver created at `t` with block 4, its transfer info sent to `p0` at `t`, and
/// `p0`'s `Ready` for block 9 with `hold` arriving `after` later: the actions it took then.
fn ready_after(t: Instant, p0: &RankInfo, after: Duration, hold: Duration) -> Vec<Action> {
    let mut m = ReceiverMachine::new(t, Timeouts::default(), TransferMode::Pull);
    m.handle(t, ReceiverEvent::Allocated { blocks: b(&[4]) });
    m.handle(
        t,
        ReceiverEvent::PeersResolved {
            peers: vec![p0.clone()],
            unwatched: vec![],
        },
    );
    drain_r(&mut m);
    m.handle(
        t + after,
        ReceiverEvent::Ready {
            from: p0.clone(),
            blocks: b(&[9]),
            aux: vec![],
            hold,
        },
    );
    drain_r(&mut m)
}

/// Decode rank `rank` of a decode engine at TP size `tp`.
fn tp_rank(tp: u32, rank: u32) -> RankInfo {
    let mut r = RankInfo::single("D");
    r.tp_size = tp;
    r.tp_rank = rank;
    r
}

fn sends_to(actions: &[Action], peer: &RankInfo) -> Vec<PeerMessage> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { to, msg } if to == peer => Some(msg.clone()),
            _ => None,
        })
        .collect()
}

/// Fan-out, push: a prefill rank at TP 1 serves both decode ranks of a TP-2 decode. It
/// waits for both transfer infos, writes to each, tells each `Done` as its write lands,
/// and is `Done` itself only when both are.
#[test]
fn a_prefill_rank_writes_to_each_decode_rank_of_a_larger_tp_and_ends_when_both_have_theirs() {
    let t = Instant::now();
    let (d0, d1) = (tp_rank(2, 0), tp_rank(2, 1));
    let mut m = SenderMachine::new(t, Timeouts::default());
    let info = |from: &RankInfo, dst: &[u32]| SenderEvent::TransferInfo {
        from: from.clone(),
        mode: TransferMode::Push,
        blocks: b(dst),
    };
    m.handle(t, info(&d0, &[7, 8]));
    assert_eq!(
        drain_s(&mut m),
        vec![],
        "one decode rank of two is not enough"
    );
    assert_eq!(*m.state(), State::Bootstrapping);
    m.handle(t, info(&d1, &[3, 4]));
    assert_eq!(drain_s(&mut m), vec![changed(State::WaitingForInput)]);
    m.handle(
        t,
        SenderEvent::Input {
            blocks: b(&[1, 2]),
            aux: b"tok".to_vec(),
        },
    );
    let deadline = t + Timeouts::default().transfer;
    let write = |to: &RankInfo, dst: &[u32]| Action::Write {
        to: to.clone(),
        src: b(&[1, 2]),
        dst: b(dst),
        deadline,
    };
    assert_eq!(
        drain_s(&mut m),
        vec![
            changed(State::Transferring),
            write(&d0, &[7, 8]),
            write(&d1, &[3, 4])
        ]
    );
    m.handle(t, SenderEvent::TransferComplete { to: d1.clone() });
    let done = PeerMessage::Done {
        aux: b"tok".to_vec(),
    };
    assert_eq!(
        drain_s(&mut m),
        vec![Action::Send {
            to: d1.clone(),
            msg: done.clone()
        }]
    );
    // A repeated completion changes nothing; nor does the loss of the decode rank that
    // has its blocks (it needs nothing more of us), while the other one's would.
    m.handle(t, SenderEvent::TransferComplete { to: d1.clone() });
    m.handle(t, SenderEvent::PeerLost { peer: d1.clone() });
    assert_eq!(drain_s(&mut m), vec![]);
    assert_eq!(m.depends_on().collect::<Vec<_>>(), vec![&d0]);
    m.handle(t, SenderEvent::TransferComplete { to: d0.clone() });
    assert_eq!(
        drain_s(&mut m),
        vec![
            Action::Send { to: d0, msg: done },
            changed(State::Done),
            released(&[1, 2], ReleaseReason::Done)
        ]
    );
}

/// Fan-out, pull, one-sided reads: `Ready` goes to both decode ranks. When the engine
/// aborts after one has read, both are told, and the blocks stay until the other confirms
/// it stopped reading.
#[test]
fn a_failed_fan_out_pull_holds_its_blocks_for_the_decode_rank_still_reading() {
    let t = Instant::now();
    let (d0, d1) = (tp_rank(2, 0), tp_rank(2, 1));
    let mut m = SenderMachine::new(t, Timeouts::default()).fence_reads(true);
    m.handle(
        t,
        SenderEvent::Input {
            blocks: b(&[5]),
            aux: vec![],
        },
    );
    for (d, dst) in [(&d0, 1), (&d1, 2)] {
        m.handle(
            t,
            SenderEvent::TransferInfo {
                from: d.clone(),
                mode: TransferMode::Pull,
                blocks: b(&[dst]),
            },
        );
    }
    let actions = drain_s(&mut m);
    for d in [&d0, &d1] {
        assert!(
            matches!(sends_to(&actions, d)[..], [PeerMessage::Ready { .. }]),
            "{d}: {actions:?}"
        );
    }
    m.handle(t, SenderEvent::ReadDone { from: d0.clone() });
    assert_eq!(drain_s(&mut m), vec![]);
    m.handle(t, SenderEvent::Abort);
    let actions = drain_s(&mut m);
    for d in [&d0, &d1] {
        assert!(
            matches!(sends_to(&actions, d)[..], [PeerMessage::Abort { .. }]),
            "{d}: {actions:?}"
        );
    }
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Release { .. })),
        "released while decode rank 1 may be reading: {actions:?}"
    );
    assert!(!m.is_settled());
    // Decode rank 0 had finished: its acknowledgement lifts nothing; rank 1's does.
    m.handle(t, SenderEvent::AbortAck { from: d0 });
    assert_eq!(drain_s(&mut m), vec![]);
    m.handle(t, SenderEvent::AbortAck { from: d1 });
    assert_eq!(
        drain_s(&mut m),
        vec![released(
            &[5],
            ReleaseReason::Failed {
                reason: FailureReason::AbortedByEngine,
                fence: Some(FenceEnd::Confirmed)
            }
        )]
    );
    assert!(m.is_settled());
}

/// A decode rank whose transfer info arrives after the request failed (its sibling's
/// came, then the bootstrap deadline passed) is told at once, not left to its deadline;
/// in push mode it may also release its blocks (nothing of ours was written there).
#[test]
fn a_decode_rank_that_comes_after_the_failure_is_told_at_once() {
    let t = Instant::now();
    let (d0, d1) = (tp_rank(2, 0), tp_rank(2, 1));
    let timeouts = Timeouts::default();
    let mut m = SenderMachine::new(t, timeouts);
    m.handle(
        t,
        SenderEvent::TransferInfo {
            from: d0.clone(),
            mode: TransferMode::Push,
            blocks: b(&[1]),
        },
    );
    let late = t + timeouts.bootstrap;
    m.handle_timeout(late);
    let actions = drain_s(&mut m);
    assert_eq!(
        sends_to(&actions, &d0),
        vec![
            PeerMessage::Abort {
                reason: FailureReason::BootstrapTimeout
            },
            PeerMessage::AbortAck
        ]
    );
    m.handle(
        late,
        SenderEvent::TransferInfo {
            from: d1.clone(),
            mode: TransferMode::Push,
            blocks: b(&[2]),
        },
    );
    assert_eq!(
        sends_to(&drain_s(&mut m), &d1),
        vec![
            PeerMessage::Abort {
                reason: FailureReason::BootstrapTimeout
            },
            PeerMessage::AbortAck
        ]
    );
}

/// Pairings that cannot be: a decode rank whose TP rank does not read from this prefill
/// rank, a rank of another decode, and a second rank in the same TP slot. Each fails the
/// request by name, and the rank that asked is told.
#[test]
fn a_decode_rank_outside_this_prefill_ranks_share_is_refused_by_name() {
    let t = Instant::now();
    let prefill_rank_0 = || SenderMachine::new(t, Timeouts::default()).tp(2, 0);
    let info = |from: &RankInfo| SenderEvent::TransferInfo {
        from: from.clone(),
        mode: TransferMode::Push,
        blocks: b(&[1]),
    };
    // Decode tp 4: ranks 0 and 1 read from prefill rank 0; rank 2 from prefill rank 1.
    let stranger = tp_rank(4, 2);
    let mut m = prefill_rank_0();
    m.handle(t, info(&stranger));
    let actions = drain_s(&mut m);
    assert!(
        matches!(&sends_to(&actions, &stranger)[..], [PeerMessage::Abort { reason: FailureReason::Protocol { detail } }] if detail.contains("does not read from prefill tp rank 0")),
        "{actions:?}"
    );
    // Decode tp 3 against prefill tp 2: neither divides the other.
    let mut m = prefill_rank_0();
    m.handle(t, info(&tp_rank(3, 0)));
    assert!(
        matches!(m.state(), State::Failed(FailureReason::Protocol { detail }) if detail.contains("neither divides")),
        "{:?}",
        m.state()
    );
    // A rank of another dp group of the decode, after rank 0 paired.
    let mut m = prefill_rank_0();
    m.handle(t, info(&tp_rank(4, 0)));
    let mut other = tp_rank(4, 1);
    other.dp_rank = 1;
    m.handle(t, info(&other));
    assert!(
        matches!(m.state(), State::Failed(FailureReason::Protocol { detail }) if detail.contains("another decode")),
        "{:?}",
        m.state()
    );
}

/// A push over a one-sided plane with a prefill rank its driver cannot watch (another
/// host) runs as pull, decided before the transfer info goes out: the info says pull, the
/// rank's `Ready` is read by decode itself, and a `Done` (a write) is refused. Over a plane
/// that checks every write (not fenced), or with every rank watched, it stays a push.
#[test]
fn a_push_with_a_writer_that_cannot_be_watched_runs_as_pull() {
    let t = Instant::now();
    let (p0, p1) = (rank("P", 0), rank("P", 1));
    let resolve = |fence: bool, unwatched: Vec<RankInfo>| {
        let mut m =
            ReceiverMachine::new(t, Timeouts::default(), TransferMode::Push).fence_writes(fence);
        let peers = vec![p0.clone(), p1.clone()];
        m.handle(t, ReceiverEvent::PeersResolved { peers, unwatched });
        m.handle(t, ReceiverEvent::Allocated { blocks: b(&[4, 5]) });
        m
    };
    let infos = |actions: &[Action]| -> Vec<TransferMode> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send {
                    msg: PeerMessage::TransferInfo { mode, .. },
                    ..
                } => Some(*mode),
                _ => None,
            })
            .collect()
    };
    // Fenced, p1 unwatched: pull, said before the transfer info.
    let mut m = resolve(true, vec![p1.clone()]);
    let actions = drain_r(&mut m);
    assert_eq!(
        actions[0],
        Action::PullsInstead {
            unwatched: vec![p1.clone()]
        }
    );
    assert_eq!(infos(&actions), vec![TransferMode::Pull; 2]);
    assert_eq!(m.mode(), TransferMode::Pull);
    m.handle(
        t,
        ReceiverEvent::Ready {
            from: p1.clone(),
            blocks: b(&[8, 9]),
            aux: vec![],
            hold: Duration::from_secs(30),
        },
    );
    assert!(drain_r(&mut m).iter().any(|a| matches!(
        a,
        Action::Read { from, src, dst, .. } if *from == p1 && *src == b(&[8, 9]) && *dst == b(&[4, 5])
    )));
    // A write's `Done` does not fit a pull: the request fails by name.
    m.handle(
        t,
        ReceiverEvent::Done {
            from: p0.clone(),
            aux: vec![],
        },
    );
    assert!(matches!(m.state(), State::Failed(_)), "{:?}", m.state());
    // Not fenced (a plane that checks every write), or every rank watched: a push.
    for (fence, unwatched) in [(false, vec![p1.clone()]), (true, vec![])] {
        let mut m = resolve(fence, unwatched);
        let actions = drain_r(&mut m);
        assert!(!actions
            .iter()
            .any(|a| matches!(a, Action::PullsInstead { .. })));
        assert_eq!(infos(&actions), vec![TransferMode::Push; 2]);
    }
    // A rank named unwatched that is not one of the request's counts for nothing.
    let mut m = resolve(true, vec![rank("Q", 0)]);
    assert_eq!(infos(&drain_r(&mut m)), vec![TransferMode::Push; 2]);
}
