//! The runtime end to end in one process, in virtual time (`start_paused`): prefill and
//! decode runtimes on one in-process fabric, real bytes moved between their regions.
//! Includes the actor-level reproductions of the three seeds.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use handoff_actors::link::{
    LinkError, ResolveFuture, TransferFuture, UnwatchedFuture, PLANE_ANSWER_GRACE,
};
use handoff_actors::machine::{Peer, PeerMessage};
use handoff_actors::{
    merge, Attach, BlockId, EngineId, Error, Event, Fabric, FailureReason, Inbox, KvLayout,
    KvShape, LayerSpan, Link, RankInfo, ReceiverSpec, Region, RequestId, Role, Runtime, State,
    Timeouts, TransferMode, TransportChoice,
};
use handoff_transport::tp::HeadOrder;
use handoff_transport::KvHeads;

const BLOCKS: u32 = 64;
const BLOCK_BYTES: usize = 256;

fn timeouts() -> Timeouts {
    Timeouts {
        bootstrap: Duration::from_secs(30),
        waiting: Duration::from_secs(30),
        transfer: Duration::from_secs(10),
        pull_ttl: Duration::from_secs(60),
    }
}

fn rank(engine: &str, pp: u32, pp_size: u32) -> RankInfo {
    let mut r = RankInfo::single(engine);
    r.pp_rank = pp;
    r.pp_size = pp_size;
    r
}

async fn start(fabric: &Arc<Fabric>, role: Role, rank: RankInfo, mode: TransferMode) -> Runtime {
    start_with(fabric, role, rank, mode, BLOCK_BYTES).await
}

async fn start_with(
    fabric: &Arc<Fabric>,
    role: Role,
    rank: RankInfo,
    mode: TransferMode,
    block_bytes: usize,
) -> Runtime {
    let region = Arc::new(Region::new(BLOCKS, block_bytes).unwrap());
    Runtime::builder(role, rank)
        .timeouts(timeouts())
        .mode(mode)
        .transport(TransportChoice::InProcess(fabric.clone()))
        .region(region)
        .start()
        .await
        .unwrap()
}

fn fill(rt: &Runtime, blocks: &[BlockId], seed: u8) {
    for b in blocks {
        let byte = seed.wrapping_add(b.0 as u8);
        rt.region().write_block(*b, &[byte; BLOCK_BYTES]).unwrap();
    }
}

fn blocks(range: std::ops::Range<u32>) -> Vec<BlockId> {
    range.map(BlockId).collect()
}

fn spec(prefill: &str, blocks: Option<Vec<BlockId>>) -> ReceiverSpec {
    ReceiverSpec {
        prefill: EngineId::new(prefill),
        prefill_dp_rank: None,
        blocks,
    }
}

/// Final states and released blocks per request, from a runtime's events; also checks that
/// no block is released twice.
#[derive(Default, Debug)]
struct Outcomes {
    last: BTreeMap<RequestId, State>,
    released: BTreeMap<RequestId, Vec<BlockId>>,
}

impl Outcomes {
    fn absorb(&mut self, events: Vec<Event>) {
        for e in events {
            match e {
                Event::State { id, state, .. } => {
                    if let Some(prev) = self.last.get(&id) {
                        assert!(state.phase() > prev.phase(), "{id}: {prev} -> {state}");
                    }
                    self.last.insert(id, state);
                }
                Event::Released { id, blocks, .. } => {
                    let all = self.released.entry(id).or_default();
                    for b in blocks {
                        assert!(!all.contains(&b), "block {b} released twice");
                        all.push(b);
                    }
                }
            }
        }
    }

    fn state(&self, id: &str) -> &State {
        &self.last[&RequestId::new(id)]
    }

    fn released(&self, id: &str) -> Vec<BlockId> {
        let mut b = self
            .released
            .get(&RequestId::new(id))
            .cloned()
            .unwrap_or_default();
        b.sort();
        b
    }
}

async fn settle() {
    // Lets every actor run; in paused time this advances no clock.
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

async fn transfers_requests(mode: TransferMode) {
    let fabric = Fabric::new();
    let p = start(&fabric, Role::Prefill, rank("P", 0, 1), mode).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), mode).await;
    let mut handles = Vec::new();
    for i in 0..4u32 {
        let id = format!("req-{i}");
        let src = blocks(i * 4..i * 4 + 4);
        let dst = blocks(32 + i * 4..32 + i * 4 + 4);
        fill(&p, &src, 7);
        // Decode first for some, prefill first for others: both orders must work.
        let (s, r) = if i % 2 == 0 {
            let r = d
                .receiver(id.as_str(), spec("P", Some(dst.clone())))
                .unwrap();
            (p.sender(id.as_str()).unwrap(), r)
        } else {
            let s = p.sender(id.as_str()).unwrap();
            (
                s,
                d.receiver(id.as_str(), spec("P", Some(dst.clone())))
                    .unwrap(),
            )
        };
        s.send(src.clone()).unwrap();
        handles.push((s, r, src, dst));
    }
    for (s, r, src, dst) in &handles {
        assert_eq!(r.completion().await, State::Done, "decode {}", r.id());
        assert_eq!(s.completion().await, State::Done, "prefill {}", s.id());
        for (a, b) in src.iter().zip(dst) {
            assert_eq!(
                p.region().read_block(*a).unwrap(),
                d.region().read_block(*b).unwrap()
            );
        }
    }
    settle().await;
    let (mut po, mut dout) = (Outcomes::default(), Outcomes::default());
    po.absorb(p.drain_events());
    dout.absorb(d.drain_events());
    for (i, (_, _, src, dst)) in handles.iter().enumerate() {
        let id = format!("req-{i}");
        assert_eq!(po.state(&id), &State::Done);
        assert_eq!(dout.state(&id), &State::Done);
        assert_eq!(&po.released(&id), src);
        assert_eq!(&dout.released(&id), dst);
    }
    assert_eq!(p.open_requests(), 0);
    assert_eq!(d.open_requests(), 0);
}

#[tokio::test(start_paused = true)]
async fn push_mode_moves_the_bytes_and_releases_every_block_once() {
    transfers_requests(TransferMode::Push).await;
}

#[tokio::test(start_paused = true)]
async fn pull_mode_moves_the_bytes_and_releases_every_block_once() {
    transfers_requests(TransferMode::Pull).await;
}

/// Seed 002: decode never reads (its abort, and prefill's `Ready`, are lost in flight).
/// Prefill frees the blocks when their TTL ends, and the engine is told.
#[tokio::test(start_paused = true)]
async fn sender_frees_blocks_at_ttl_when_decode_never_reads() {
    let fabric = Fabric::new();
    let p = start(&fabric, Role::Prefill, rank("P", 0, 1), TransferMode::Pull).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Pull).await;
    // Only decode's transfer info gets through; everything after it is lost.
    fabric.set_filter(|_, _, _, msg| matches!(msg, PeerMessage::TransferInfo { .. }));
    let s = p.sender("r").unwrap();
    let r = d.receiver("r", spec("P", Some(blocks(10..13)))).unwrap();
    s.send(blocks(0..3)).unwrap();
    let t0 = tokio::time::Instant::now();
    assert_eq!(
        r.completion().await,
        State::Failed(FailureReason::WaitingTimeout)
    );
    assert_eq!(
        s.completion().await,
        State::Failed(FailureReason::TtlExpired)
    );
    let held_for = t0.elapsed();
    assert!(
        held_for >= timeouts().pull_ttl && held_for < timeouts().pull_ttl + Duration::from_secs(1),
        "{held_for:?}"
    );
    settle().await;
    let mut po = Outcomes::default();
    po.absorb(p.drain_events());
    assert_eq!(
        po.released("r"),
        blocks(0..3),
        "prefill must free its blocks at the TTL"
    );
    let mut dout = Outcomes::default();
    dout.absorb(d.drain_events());
    assert_eq!(dout.released("r"), blocks(10..13));
}

/// Seed 003: decode is saturated (never allocates), prefill runs PP=2 and its ranks start
/// the request at different times (skew). The first rank to time out fails the request on
/// every rank at once, as messages: no rank waits out its own timeout, nothing asserts,
/// and each rank frees its blocks.
/// Two prefill pipeline ranks each hold their layers, half of every block; decode holds
/// whole blocks. Each rank's half lands in its place (push: each rank writes it; pull:
/// decode reads it from each rank), and nothing else of decode's block is touched.
async fn pipeline_halves_fill_whole_decode_blocks(mode: TransferMode) {
    let fabric = Fabric::new();
    let half = BLOCK_BYTES / 2;
    let p0 = start_with(&fabric, Role::Prefill, rank("P", 0, 2), mode, half).await;
    let p1 = start_with(&fabric, Role::Prefill, rank("P", 1, 2), mode, half).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), mode).await;
    let (src0, src1, dst) = (blocks(0..3), blocks(10..13), blocks(40..43));
    for (k, (a, b)) in src0.iter().zip(&src1).enumerate() {
        p0.region()
            .write_block(*a, &vec![k as u8 + 1; half])
            .unwrap();
        p1.region()
            .write_block(*b, &vec![k as u8 + 101; half])
            .unwrap();
    }
    let r = d.receiver("r", spec("P", Some(dst.clone()))).unwrap();
    let s0 = p0.sender("r").unwrap();
    let s1 = p1.sender("r").unwrap();
    s0.send(src0).unwrap();
    s1.send(src1).unwrap();
    assert_eq!(r.completion().await, State::Done);
    assert_eq!(s0.completion().await, State::Done);
    assert_eq!(s1.completion().await, State::Done);
    for (k, b) in dst.iter().enumerate() {
        let got = d.region().read_block(*b).unwrap();
        assert_eq!(
            &got[..half],
            vec![k as u8 + 1; half],
            "{mode:?}: block {b}, rank 0's half"
        );
        assert_eq!(
            &got[half..],
            vec![k as u8 + 101; half],
            "{mode:?}: block {b}, rank 1's half"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn pipeline_ranks_each_push_their_half_of_every_block() {
    pipeline_halves_fill_whole_decode_blocks(TransferMode::Push).await;
}

#[tokio::test(start_paused = true)]
async fn decode_pulls_each_pipeline_ranks_half_of_every_block() {
    pipeline_halves_fill_whole_decode_blocks(TransferMode::Pull).await;
}

/// Pipeline ranks whose blocks do not add up to decode's (an uneven layer split, or a
/// different model) fail the request by name instead of moving misplaced bytes.
#[tokio::test(start_paused = true)]
async fn pipeline_ranks_with_blocks_that_do_not_add_up_fail_by_name() {
    let fabric = Fabric::new();
    let mode = TransferMode::Push;
    let p0 = start_with(&fabric, Role::Prefill, rank("P", 0, 2), mode, 64).await;
    let p1 = start_with(&fabric, Role::Prefill, rank("P", 1, 2), mode, 64).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), mode).await; // 256, not 128
    let r = d.receiver("r", spec("P", Some(blocks(0..2)))).unwrap();
    let s0 = p0.sender("r").unwrap();
    let s1 = p1.sender("r").unwrap();
    s0.send(blocks(0..2)).unwrap();
    s1.send(blocks(0..2)).unwrap();
    let on_decode = r.completion().await;
    assert!(on_decode.failure().is_some(), "{on_decode}");
    assert!(
        format!("{on_decode}").contains("whole-model blocks differ"),
        "{on_decode}"
    );
    for s in [s0, s1] {
        assert!(s.completion().await.failure().is_some());
    }
}

#[tokio::test(start_paused = true)]
async fn pipeline_ranks_that_disagree_in_time_fail_together() {
    let fabric = Fabric::new();
    let p0 = start(&fabric, Role::Prefill, rank("P", 0, 2), TransferMode::Push).await;
    let p1 = start(&fabric, Role::Prefill, rank("P", 1, 2), TransferMode::Push).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Push).await;
    let s0 = p0.sender("r").unwrap();
    s0.send(blocks(0..4)).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Decode is saturated: it opens the request late and has no blocks for it.
    let r = d.receiver("r", spec("P", None)).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await; // rank 1 is 5 s behind rank 0
    let s1 = p1.sender("r").unwrap();
    s1.send(blocks(8..12)).unwrap();
    settle().await;
    // Decode said Queued to both ranks; both still bootstrapping; the merge is total.
    assert_eq!(s0.poll(), State::Bootstrapping);
    assert_eq!(s1.poll(), State::Bootstrapping);
    let first = s0.completion().await;
    let t0 = tokio::time::Instant::now();
    assert_eq!(first, State::Failed(FailureReason::BootstrapTimeout));
    // Seed 003's crash: one rank Failed while the other may still be Bootstrapping.
    assert!(merge(&first, &s1.poll()).failure().is_some());
    let second = s1.completion().await;
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "rank 1 waited out its own timeout"
    );
    assert!(
        matches!(second, State::Failed(FailureReason::AbortedByPeer { .. })),
        "{second}"
    );
    let on_decode = r.completion().await;
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "decode waited out its own timeout"
    );
    assert!(
        matches!(
            on_decode,
            State::Failed(FailureReason::AbortedByPeer { .. })
        ),
        "{on_decode}"
    );
    settle().await;
    let (mut o0, mut o1) = (Outcomes::default(), Outcomes::default());
    o0.absorb(p0.drain_events());
    o1.absorb(p1.drain_events());
    assert_eq!(o0.released("r"), blocks(0..4));
    assert_eq!(o1.released("r"), blocks(8..12));
    // A late allocation on decode is refused and the blocks stay the engine's.
    match r.allocate(blocks(0..2)) {
        Err(Error::RequestEnded { blocks: b, .. }) => assert_eq!(b, blocks(0..2)),
        other => panic!("expected RequestEnded, got {other:?}"),
    }
}

/// Seed 001: prefill never answers (its engine never opens the request). Decode fails at
/// its waiting deadline with a named reason instead of waiting forever.
#[tokio::test(start_paused = true)]
async fn receiver_fails_at_waiting_deadline_when_prefill_never_answers() {
    let fabric = Fabric::new();
    let _p = start(&fabric, Role::Prefill, rank("P", 0, 1), TransferMode::Push).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Push).await;
    let r = d.receiver("r", spec("P", Some(blocks(0..2)))).unwrap();
    let t0 = tokio::time::Instant::now();
    assert_eq!(
        r.completion().await,
        State::Failed(FailureReason::WaitingTimeout)
    );
    assert!(t0.elapsed() <= timeouts().waiting + Duration::from_millis(10));
    settle().await;
    let mut o = Outcomes::default();
    o.absorb(d.drain_events());
    assert_eq!(o.released("r"), blocks(0..2));
}

/// Seed 001: no prefill registered at all: decode keeps asking (bounded backoff) and fails
/// at its bootstrap deadline; nothing crashes.
#[tokio::test(start_paused = true)]
async fn receiver_fails_at_bootstrap_deadline_when_no_prefill_is_registered() {
    let fabric = Fabric::new();
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Push).await;
    let r = d.receiver("r", spec("nobody", Some(blocks(0..2)))).unwrap();
    assert_eq!(
        r.completion().await,
        State::Failed(FailureReason::BootstrapTimeout)
    );
}

/// A panic inside one request's actor fails that request (`Internal`), releases its blocks
/// on both sides, tells the engine, and nothing else notices.
#[tokio::test(start_paused = true)]
async fn a_panicking_request_actor_fails_only_its_request() {
    let fabric = Fabric::new();
    let p = start(&fabric, Role::Prefill, rank("P", 0, 1), TransferMode::Pull).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Pull).await;
    // Hold every Ready so the requests stay in flight while we inject the fault.
    fabric.set_filter(|_, _, _, msg| !matches!(msg, PeerMessage::Ready { .. }));
    let mut pairs = Vec::new();
    for i in 0..3u32 {
        let id = format!("r{i}");
        let s = p.sender(id.as_str()).unwrap();
        let r = d
            .receiver(id.as_str(), spec("P", Some(blocks(20 + i * 2..22 + i * 2))))
            .unwrap();
        s.send(blocks(i * 2..i * 2 + 2)).unwrap();
        pairs.push((s, r));
    }
    settle().await;
    assert_eq!(pairs[1].0.poll(), State::Transferring);
    p.inject_panic(&RequestId::new("r1"));
    let failed = pairs[1].0.completion().await;
    assert!(
        matches!(failed, State::Failed(FailureReason::Internal { .. })),
        "{failed}"
    );
    // Decode hears of it as a message, not at its deadline.
    let on_decode = pairs[1].1.completion().await;
    assert!(
        matches!(
            on_decode,
            State::Failed(FailureReason::AbortedByPeer { .. })
        ),
        "{on_decode}"
    );
    // The others finish once Ready flows again (the runtime is intact). They resend
    // nothing, so let their Ready through by starting fresh requests after the fault.
    fabric.clear_filter();
    let s = p.sender("after").unwrap();
    let r = d
        .receiver("after", spec("P", Some(blocks(40..42))))
        .unwrap();
    s.send(blocks(50..52)).unwrap();
    assert_eq!(r.completion().await, State::Done);
    assert_eq!(s.completion().await, State::Done);
    assert_eq!(
        pairs[0].0.poll(),
        State::Transferring,
        "an unrelated request was disturbed"
    );
    settle().await;
    let mut po = Outcomes::default();
    po.absorb(p.drain_events());
    assert_eq!(po.released("r1"), blocks(2..4));
    assert!(po.released("r0").is_empty(), "r0 still holds its blocks");
}

/// Blocks handed over while their request dies (its actor panics, the engine aborts it, the
/// runtime stops) reach its owner or come back on their own: every block the runtime
/// accepted is released exactly once, every block it refused stays the engine's, and every
/// request ends.
#[tokio::test(start_paused = true)]
async fn blocks_handed_over_as_a_request_dies_come_back_exactly_once() {
    let fabric = Fabric::new();
    let p = start(&fabric, Role::Prefill, rank("P", 0, 1), TransferMode::Push).await;
    let mut accepted: BTreeMap<RequestId, Vec<BlockId>> = BTreeMap::new();
    let mut handles = Vec::new();
    for i in 0..8u32 {
        let id = RequestId::new(format!("r{i}"));
        let s = p.sender(id.clone()).unwrap();
        // Let some requests' actors start before the fault; others die before theirs run.
        if i % 2 == 0 {
            settle().await;
        }
        match i % 4 {
            0 | 1 => p.inject_panic(&id),
            _ => s.abort(),
        }
        if i % 3 == 0 {
            settle().await;
        }
        match s.send(blocks(i * 4..i * 4 + 4)) {
            Ok(()) => {
                accepted.insert(id, blocks(i * 4..i * 4 + 4));
            }
            Err(Error::RequestEnded { blocks: b, .. }) => assert_eq!(b, blocks(i * 4..i * 4 + 4)),
            Err(e) => panic!("r{i}: {e}"),
        }
        handles.push(s);
    }
    // And some the runtime's stop overtakes, handed over or not.
    for i in 8..12u32 {
        let s = p.sender(format!("r{i}").as_str()).unwrap();
        if i % 2 == 0 {
            s.send(blocks(i * 4..i * 4 + 4)).unwrap();
            accepted.insert(RequestId::new(format!("r{i}")), blocks(i * 4..i * 4 + 4));
        }
        handles.push(s);
    }
    p.shutdown().await;
    let events = p.drain_events();
    let mut o = Outcomes::default();
    o.absorb(events.clone());
    for s in &handles {
        assert!(s.poll().is_terminal(), "{}: {}", s.id(), s.poll());
        let want = accepted.get(s.id()).cloned().unwrap_or_default();
        assert_eq!(o.released(s.id().as_str()), want, "{}", s.id());
    }
    // Those the stop overtook say so; those that met their request's end say late.
    let mut late = 0;
    for e in &events {
        if let Event::Released { id, why, .. } = e {
            let n: u32 = id.as_str()[1..].parse().unwrap();
            match why.as_str() {
                "late" if n < 8 => late += 1,
                "shutdown" => {}
                other => panic!("{id}: released as {other}"),
            }
        }
    }
    assert!(late > 0, "no hand-over met its request's end: {events:?}");
    assert!(
        accepted.len() >= 2,
        "the race never let a hand-over in: {accepted:?}"
    );
}

/// A lost peer fails every request depending on it at once, not at each request's deadline.
#[tokio::test(start_paused = true)]
async fn a_lost_peer_fails_its_requests_at_once() {
    let fabric = Fabric::new();
    let p = start(&fabric, Role::Prefill, rank("P", 0, 1), TransferMode::Push).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Push).await;
    let r1 = d.receiver("a", spec("P", Some(blocks(0..1)))).unwrap();
    let r2 = d.receiver("b", spec("P", Some(blocks(1..2)))).unwrap();
    settle().await;
    let t0 = tokio::time::Instant::now();
    d.peer_lost(rank("P", 0, 1));
    for r in [&r1, &r2] {
        assert!(matches!(
            r.completion().await,
            State::Failed(FailureReason::PeerLost { .. })
        ));
    }
    assert_eq!(t0.elapsed(), Duration::ZERO);
    drop(p);
}

/// A prefill request that has decode's transfer info but no blocks yet (the engine is still
/// computing) depends on that decode rank already: its loss fails the request at once, not
/// at the waiting deadline.
#[tokio::test(start_paused = true)]
async fn a_lost_decode_fails_a_sender_still_waiting_for_its_blocks() {
    let fabric = Fabric::new();
    let p = start(&fabric, Role::Prefill, rank("P", 0, 1), TransferMode::Push).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Push).await;
    let s = p.sender("a").unwrap();
    let _r = d.receiver("a", spec("P", Some(blocks(0..1)))).unwrap();
    settle().await;
    assert_eq!(s.poll(), State::WaitingForInput);
    let t0 = tokio::time::Instant::now();
    p.peer_lost(rank("D", 0, 1));
    assert!(matches!(
        s.completion().await,
        State::Failed(FailureReason::PeerLost { .. })
    ));
    assert_eq!(t0.elapsed(), Duration::ZERO);
}

/// Prefill's runtime stops mid-request: decode's sends to it fail and its requests end
/// `PeerLost` promptly; prefill's own live requests end `Failed` with blocks released.
#[tokio::test(start_paused = true)]
async fn a_stopped_runtime_fails_its_requests_and_its_peers_notice() {
    let fabric = Fabric::new();
    let p = start(&fabric, Role::Prefill, rank("P", 0, 1), TransferMode::Pull).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Pull).await;
    let s = p.sender("r").unwrap();
    s.send(blocks(0..2)).unwrap();
    p.shutdown().await;
    assert!(
        matches!(s.poll(), State::Failed(FailureReason::Internal { .. })),
        "{}",
        s.poll()
    );
    let mut po = Outcomes::default();
    po.absorb(p.drain_events());
    assert_eq!(po.released("r"), blocks(0..2));
    assert!(matches!(p.sender("x"), Err(Error::Stopped)));
    // Decode cannot find prefill any more: bootstrap deadline, no hang.
    let r = d.receiver("r", spec("P", Some(blocks(0..2)))).unwrap();
    assert_eq!(
        r.completion().await,
        State::Failed(FailureReason::BootstrapTimeout)
    );
}

/// A bug in the root (a panic in its handler) stops the runtime as `shutdown` would: every
/// request it knew ends and gives its blocks back, blocks handed over behind the panic come
/// back too, later calls are refused by name, and `shutdown` still returns. Nothing hangs on
/// a root that no longer answers.
#[tokio::test(start_paused = true)]
async fn a_panicking_root_stops_the_runtime_and_gives_every_block_back() {
    let fabric = Fabric::new();
    let p = start(&fabric, Role::Prefill, rank("P", 0, 1), TransferMode::Pull).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Pull).await;
    // Hold every Ready so the first request stays in flight.
    fabric.set_filter(|_, _, _, msg| !matches!(msg, PeerMessage::Ready { .. }));
    let s = p.sender("held").unwrap();
    let r = d.receiver("held", spec("P", Some(blocks(20..22)))).unwrap();
    s.send(blocks(0..2)).unwrap();
    settle().await;
    assert_eq!(s.poll(), State::Transferring);
    let late = p.sender("late").unwrap();
    p.inject_root_panic();
    // Queued behind the panic: these blocks reach no owner and must come back on their own.
    let _ = late.send(blocks(4..6));
    for handle in [&s, &late] {
        let end = handle.completion().await;
        assert!(
            matches!(end, State::Failed(FailureReason::Internal { .. })),
            "{end}"
        );
    }
    let mut po = Outcomes::default();
    po.absorb(p.drain_events());
    assert_eq!(po.released("held"), blocks(0..2));
    assert_eq!(po.released("late"), blocks(4..6));
    assert!(matches!(p.sender("after"), Err(Error::Stopped)));
    p.shutdown().await;
    // Decode's side is told or times out; it never hangs on the stopped prefill.
    fabric.clear_filter();
    let end = r.completion().await;
    assert!(end.is_terminal() && end != State::Done, "{end}");
}

/// Bad calls from the engine are named errors, and nothing is taken from the caller.
#[tokio::test(start_paused = true)]
async fn bad_engine_calls_are_named_errors() {
    let fabric = Fabric::new();
    let region = Arc::new(Region::new(8, 16).unwrap());
    let p = Runtime::builder(Role::Prefill, "P")
        .transport(TransportChoice::InProcess(fabric.clone()))
        .region(region.clone())
        .requests_open_max(2)
        .start()
        .await
        .unwrap();
    assert!(
        matches!(
            Runtime::builder(Role::Prefill, "P")
                .transport(TransportChoice::InProcess(fabric.clone()))
                .region(region)
                .start()
                .await,
            Err(Error::AlreadyAttached(_))
        ),
        "a second runtime with the same ranks must be refused"
    );
    let s = p.sender("a").unwrap();
    assert!(matches!(p.sender("a"), Err(Error::DuplicateRequest(_))));
    assert!(matches!(s.send(vec![BlockId(8)]), Err(Error::Region(_))));
    // A block named twice would come back twice (and be freed twice by the engine).
    match s.send(vec![BlockId(2), BlockId(1), BlockId(2)]) {
        Err(Error::DuplicateBlock { block, blocks, .. }) => {
            assert_eq!((block, blocks.len()), (BlockId(2), 3));
        }
        other => panic!("expected DuplicateBlock, got {other:?}"),
    }
    s.send(vec![BlockId(1)]).unwrap();
    assert!(matches!(
        s.send(vec![BlockId(2)]),
        Err(Error::AlreadyHandedOver(_))
    ));
    let _b = p.sender("b").unwrap();
    assert!(matches!(
        p.sender("c"),
        Err(Error::TooManyRequests { open: 2 })
    ));
    assert!(matches!(
        p.receiver("d", spec("P", None)),
        Err(Error::WrongRole(Role::Prefill))
    ));
    s.abort();
    assert_eq!(
        s.completion().await,
        State::Failed(FailureReason::AbortedByEngine)
    );
    settle().await;
    // The aborted request stays open until its final event is drained.
    assert!(matches!(p.sender("c"), Err(Error::TooManyRequests { .. })));
    let mut o = Outcomes::default();
    o.absorb(p.drain_events());
    assert_eq!(o.released("a"), vec![BlockId(1)]);
    assert!(p.sender("c").is_ok());
}

/// Seed 003, with admission control: a saturated decode rejects at once, and prefill hears
/// `Rejected(Busy)` as a message: no request waits out its bootstrap timeout.
#[tokio::test(start_paused = true)]
async fn saturated_decode_rejects_and_prefill_fails_fast() {
    let fabric = Fabric::new();
    let p0 = start(&fabric, Role::Prefill, rank("P", 0, 2), TransferMode::Push).await;
    let p1 = start(&fabric, Role::Prefill, rank("P", 1, 2), TransferMode::Push).await;
    let region = Arc::new(Region::new(BLOCKS, BLOCK_BYTES).unwrap());
    let d = Runtime::builder(Role::Decode, rank("D", 0, 1))
        .timeouts(timeouts())
        .admission(Some(1))
        .transport(TransportChoice::InProcess(fabric.clone()))
        .region(region)
        .start()
        .await
        .unwrap();
    let waiting = d.receiver("first", spec("P", None)).unwrap(); // takes the one slot
    let (s0, s1) = (p0.sender("second").unwrap(), p1.sender("second").unwrap());
    s0.send(blocks(0..2)).unwrap();
    let t0 = tokio::time::Instant::now();
    let r = d.receiver("second", spec("P", None)).unwrap();
    assert_eq!(
        r.completion().await,
        State::Failed(FailureReason::RejectedBusy)
    );
    assert_eq!(
        s0.completion().await,
        State::Failed(FailureReason::RejectedBusy)
    );
    assert_eq!(
        s1.completion().await,
        State::Failed(FailureReason::RejectedBusy)
    );
    assert!(
        t0.elapsed() < Duration::from_millis(100),
        "{:?}",
        t0.elapsed()
    );
    settle().await;
    let mut o = Outcomes::default();
    o.absorb(p0.drain_events());
    assert_eq!(o.released("second"), blocks(0..2));
    // The engine can also refuse explicitly.
    waiting.reject_busy();
    assert_eq!(
        waiting.completion().await,
        State::Failed(FailureReason::RejectedBusy)
    );
}

/// Found by the simulator: decode gives up (waiting deadline) and releases its blocks,
/// its abort is lost, and prefill writes afterwards. The write must not land in blocks the
/// engine has taken back: the grant ended with the request, so the write is refused and
/// prefill's request fails instead.
#[tokio::test(start_paused = true)]
async fn a_late_write_never_lands_in_blocks_decode_released() {
    let fabric = Fabric::new();
    let patient = Timeouts {
        waiting: Duration::from_secs(120),
        ..timeouts()
    };
    let p = Runtime::builder(Role::Prefill, rank("P", 0, 1))
        .timeouts(patient)
        .transport(TransportChoice::InProcess(fabric.clone()))
        .region(Arc::new(Region::new(BLOCKS, BLOCK_BYTES).unwrap()))
        .start()
        .await
        .unwrap();
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Push).await;
    fabric.set_filter(|_, _, _, msg| !matches!(msg, PeerMessage::Abort { .. })); // aborts are lost
    let s = p.sender("r").unwrap();
    let r = d.receiver("r", spec("P", Some(blocks(10..12)))).unwrap();
    assert_eq!(
        r.completion().await,
        State::Failed(FailureReason::WaitingTimeout)
    );
    settle().await;
    // The engine reuses the released blocks for something else.
    for b in blocks(10..12) {
        d.region().write_block(b, &[0xEE; BLOCK_BYTES]).unwrap();
    }
    // Prefill, still within its own deadline, finally hands its blocks over and writes.
    fill(&p, &blocks(0..2), 1);
    s.send(blocks(0..2)).unwrap();
    let end = s.completion().await;
    assert!(
        matches!(&end, State::Failed(FailureReason::TransferFailed { detail }) if detail.contains("revoked") || detail.contains("no grant")),
        "{end}"
    );
    for b in blocks(10..12) {
        assert_eq!(
            d.region().read_block(b).unwrap(),
            vec![0xEE; BLOCK_BYTES],
            "a late write landed in {b}"
        );
    }
}

/// Found by the simulator: a decode request that fails before it has resolved its prefill
/// ranks still tells them (a brief lookup), so prefill does not wait out its deadline.
#[tokio::test(start_paused = true)]
async fn a_receiver_that_fails_before_resolving_still_tells_prefill() {
    let fabric = Fabric::new();
    let p = start(&fabric, Role::Prefill, rank("P", 0, 1), TransferMode::Push).await;
    let d = start(&fabric, Role::Decode, rank("D", 0, 1), TransferMode::Push).await;
    let s = p.sender("r").unwrap();
    s.send(blocks(0..2)).unwrap();
    settle().await;
    let r = d.receiver("r", spec("P", None)).unwrap();
    r.abort(); // before the lookup's answer is back
    assert_eq!(
        r.completion().await,
        State::Failed(FailureReason::AbortedByEngine)
    );
    let t0 = tokio::time::Instant::now();
    let end = s.completion().await;
    assert!(
        matches!(end, State::Failed(FailureReason::AbortedByPeer { .. })),
        "{end}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "prefill waited {:?}",
        t0.elapsed()
    );
}

/// Found by the simulator: transfer info for a request prefill's engine never opens is
/// answered with an abort at prefill's bootstrap deadline, not silently dropped.
#[tokio::test(start_paused = true)]
async fn transfer_info_for_a_request_never_opened_is_answered_at_the_deadline() {
    let fabric = Fabric::new();
    let _p = start(&fabric, Role::Prefill, rank("P", 0, 1), TransferMode::Push).await;
    let patient = Timeouts {
        waiting: Duration::from_secs(120),
        ..timeouts()
    };
    let d = Runtime::builder(Role::Decode, rank("D", 0, 1))
        .timeouts(patient)
        .transport(TransportChoice::InProcess(fabric.clone()))
        .region(Arc::new(Region::new(BLOCKS, BLOCK_BYTES).unwrap()))
        .start()
        .await
        .unwrap();
    let t0 = tokio::time::Instant::now();
    let r = d
        .receiver("never-opened", spec("P", Some(blocks(0..2))))
        .unwrap();
    let end = r.completion().await;
    assert!(
        matches!(&end, State::Failed(FailureReason::AbortedByPeer { cause, .. }) if cause.contains("bootstrap")),
        "{end}"
    );
    let took = t0.elapsed();
    assert!(
        took >= timeouts().bootstrap && took < timeouts().bootstrap + Duration::from_secs(1),
        "{took:?}"
    );
}

// ---- KV caches as engines hold them: different layouts on the two sides. ----

/// A runtime over a region laid out like an engine's tensors (`layout`'s addresses are
/// offsets into a fresh allocation).
async fn start_laid_out(
    fabric: &Arc<Fabric>,
    role: Role,
    rank: RankInfo,
    mode: TransferMode,
    layout: KvLayout,
) -> Runtime {
    let region = Arc::new(Region::alloc(layout).unwrap());
    Runtime::builder(role, rank)
        .timeouts(timeouts())
        .mode(mode)
        .transport(TransportChoice::InProcess(fabric.clone()))
        .region(region)
        .start()
        .await
        .unwrap()
}

/// Distinct bytes for every byte of every block: a byte moved to the wrong place shows.
fn pattern(block: BlockId, len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ (block.0 as u8).wrapping_mul(7) ^ seed)
        .collect()
}

/// The bytes of `len` logical bytes at `offset` of `block`, read from the region's own
/// ranges (physical memory), not through the logical copy.
fn physical(region: &Region, block: BlockId, offset: usize, len: usize) -> Vec<u8> {
    let mut segments = Vec::new();
    region
        .segments_into(block, offset, len, &mut segments)
        .unwrap();
    segments
        .iter()
        // SAFETY: the segments are the region's own; the request that wrote them ended.
        .flat_map(|s| unsafe { region.host_bytes(s) }.unwrap().to_vec())
        .collect()
}

/// Prefill holds vLLM-style per-layer tensors (K and V halves: 2 ranges per layer, 4
/// layers), decode FlashInfer-style interleaved ones (1 range per layer): every byte of
/// every block lands in the right place of decode's ranges.
async fn per_layer_blocks_land_in_interleaved_blocks(mode: TransferMode) {
    let fabric = Fabric::new();
    let (layers, half) = (4, 16);
    let p = start_laid_out(
        &fabric,
        Role::Prefill,
        rank("P", 0, 1),
        mode,
        KvLayout::shaped(KvShape::KvHalves, layers, BLOCKS, half),
    )
    .await;
    let d = start_laid_out(
        &fabric,
        Role::Decode,
        rank("D", 0, 1),
        mode,
        KvLayout::shaped(KvShape::LayerBlocks, layers, BLOCKS, half),
    )
    .await;
    assert_eq!(p.region().layout().ranges.len(), 8);
    assert_eq!(d.region().layout().ranges.len(), 4);
    let block_bytes = p.region().block_bytes();
    let (src, dst) = (
        blocks(3..9),
        vec![
            BlockId(50),
            BlockId(2),
            BlockId(40),
            BlockId(41),
            BlockId(42),
            BlockId(7),
        ],
    );
    for b in &src {
        p.region()
            .write_block(*b, &pattern(*b, block_bytes, 0x5a))
            .unwrap();
    }
    let r = d.receiver("r", spec("P", Some(dst.clone()))).unwrap();
    let s = p.sender("r").unwrap();
    s.send(src.clone()).unwrap();
    assert_eq!(r.completion().await, State::Done, "{mode:?}");
    assert_eq!(s.completion().await, State::Done, "{mode:?}");
    for (from, to) in src.iter().zip(&dst) {
        let want = pattern(*from, block_bytes, 0x5a);
        assert_eq!(
            d.region().read_block(*to).unwrap(),
            want,
            "{mode:?}: block {to}"
        );
        for layer in 0..layers as usize {
            // Decode's range `layer` holds prefill's layer-`layer` K half then V half.
            let at = layer * 2 * half;
            assert_eq!(
                physical(d.region(), *to, at, 2 * half),
                physical(p.region(), *from, at, 2 * half),
                "{mode:?}: block {to}, layer {layer}"
            );
        }
    }
    // Decode blocks outside the request stay untouched.
    assert_eq!(
        d.region().read_block(BlockId(0)).unwrap(),
        vec![0; block_bytes]
    );
}

#[tokio::test(start_paused = true)]
async fn per_layer_prefill_pushes_into_interleaved_decode_byte_for_byte() {
    per_layer_blocks_land_in_interleaved_blocks(TransferMode::Push).await;
}

#[tokio::test(start_paused = true)]
async fn interleaved_decode_pulls_from_per_layer_prefill_byte_for_byte() {
    per_layer_blocks_land_in_interleaved_blocks(TransferMode::Pull).await;
}

/// 61 layers over 2 prefill pipeline stages (31 + 30, per-layer tensors), decode holding
/// all 61 in one contiguous allocation: each stage's layers land in their place.
async fn uneven_pipeline_stages_fill_whole_blocks(mode: TransferMode) {
    let fabric = Fabric::new();
    let half = 4;
    let stage = |first, count| {
        let mut layout = KvLayout::shaped(KvShape::KvHalves, count, BLOCKS, half);
        layout.layers = LayerSpan {
            first,
            count,
            total: 61,
        };
        layout
    };
    let p0 = start_laid_out(&fabric, Role::Prefill, rank("P", 0, 2), mode, stage(0, 31)).await;
    let p1 = start_laid_out(&fabric, Role::Prefill, rank("P", 1, 2), mode, stage(31, 30)).await;
    let d = start_laid_out(
        &fabric,
        Role::Decode,
        rank("D", 0, 1),
        mode,
        KvLayout::shaped(KvShape::Contiguous, 61, BLOCKS, half),
    )
    .await;
    let (src0, src1, dst) = (blocks(0..3), blocks(10..13), blocks(40..43));
    let (bytes0, bytes1) = (p0.region().block_bytes(), p1.region().block_bytes());
    assert_eq!((bytes0, bytes1, d.region().block_bytes()), (248, 240, 488));
    for (a, b) in src0.iter().zip(&src1) {
        p0.region()
            .write_block(*a, &pattern(*a, bytes0, 1))
            .unwrap();
        p1.region()
            .write_block(*b, &pattern(*b, bytes1, 2))
            .unwrap();
    }
    let r = d.receiver("r", spec("P", Some(dst.clone()))).unwrap();
    let s0 = p0.sender("r").unwrap();
    let s1 = p1.sender("r").unwrap();
    s0.send(src0.clone()).unwrap();
    s1.send(src1.clone()).unwrap();
    assert_eq!(r.completion().await, State::Done, "{mode:?}");
    assert_eq!(s0.completion().await, State::Done);
    assert_eq!(s1.completion().await, State::Done);
    for ((a, b), to) in src0.iter().zip(&src1).zip(&dst) {
        let got = d.region().read_block(*to).unwrap();
        assert_eq!(
            got[..bytes0],
            pattern(*a, bytes0, 1),
            "{mode:?}: {to}, layers 0..31"
        );
        assert_eq!(
            got[bytes0..],
            pattern(*b, bytes1, 2),
            "{mode:?}: {to}, layers 31..61"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_uneven_pipeline_split_pushes_each_stages_layers_into_place() {
    uneven_pipeline_stages_fill_whole_blocks(TransferMode::Push).await;
}

#[tokio::test(start_paused = true)]
async fn decode_pulls_each_stage_of_an_uneven_split_into_place() {
    uneven_pipeline_stages_fill_whole_blocks(TransferMode::Pull).await;
}

/// Prefill and decode runtimes (push) whose layouts are of the same size but disagree on
/// tokens per block (another model, or a misconfigured engine).
async fn layouts_that_do_not_pair() -> (Runtime, Runtime) {
    let fabric = Fabric::new();
    let mode = TransferMode::Push;
    let mut ours = KvLayout::shaped(KvShape::KvHalves, 4, BLOCKS, 16);
    ours.block_tokens = 16;
    let mut theirs = KvLayout::shaped(KvShape::LayerBlocks, 4, BLOCKS, 16);
    theirs.block_tokens = 32;
    let p = start_laid_out(&fabric, Role::Prefill, rank("P", 0, 1), mode, ours).await;
    let d = start_laid_out(&fabric, Role::Decode, rank("D", 0, 1), mode, theirs).await;
    (p, d)
}

/// Two layouts of the same size that disagree on tokens per block (another model, or a
/// misconfigured engine) fail the request by name on both sides; not a byte moves.
#[tokio::test(start_paused = true)]
async fn layouts_that_do_not_pair_fail_by_name_before_a_byte_moves() {
    let (p, d) = layouts_that_do_not_pair().await;
    p.region().write_block(BlockId(1), &[9; 128]).unwrap();
    let r = d.receiver("r", spec("P", Some(vec![BlockId(5)]))).unwrap();
    let s = p.sender("r").unwrap();
    s.send(vec![BlockId(1)]).unwrap();
    let on_prefill = s.completion().await;
    let on_decode = r.completion().await;
    for outcome in [&on_prefill, &on_decode] {
        assert!(
            format!("{outcome}").contains("tokens per block differ"),
            "{outcome}"
        );
    }
    assert!(
        matches!(on_prefill.failure(), Some(FailureReason::Protocol { .. })),
        "{on_prefill}"
    );
    assert_eq!(d.region().read_block(BlockId(5)).unwrap(), vec![0; 128]);
}

/// The same, with decode's transfer info at prefill before prefill's engine opened the
/// request: the info that cannot pair waits for the open like any early message and fails
/// the request by name there, which tells decode. (Dropped, as it was, it left decode in
/// `WaitingForInput` until its own deadline: found by the Python layouts test, 30 s.)
#[tokio::test(start_paused = true)]
async fn layouts_that_do_not_pair_fail_by_name_when_decode_asks_before_prefill_opens() {
    let (p, d) = layouts_that_do_not_pair().await;
    let opened = tokio::time::Instant::now();
    let r = d.receiver("r", spec("P", Some(vec![BlockId(5)]))).unwrap();
    // Decode's transfer info out (and so at prefill's root, in process) before the open.
    tokio::time::timeout(Duration::from_secs(5), async {
        while r.poll() != State::WaitingForInput {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("decode sent its transfer info");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let s = p.sender("r").unwrap();
    // The open fails it at once: the blocks may stay the engine's.
    let _ = s.send(vec![BlockId(1)]);
    let on_prefill = s.completion().await;
    let on_decode = r.completion().await;
    for outcome in [&on_prefill, &on_decode] {
        assert!(
            format!("{outcome}").contains("tokens per block differ"),
            "{outcome}"
        );
    }
    assert!(
        opened.elapsed() < timeouts().waiting,
        "decode learnt it only at its deadline"
    );
    assert_eq!(d.region().read_block(BlockId(5)).unwrap(), vec![0; 128]);
}

/// How [`BrokenTransfers`] breaks its victim's transfers.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// The plane's future panics (a bug in a data plane, as the request actor polls it).
    Panics,
    /// The plane never answers (a stuck plane), which is taken as one-sided.
    Hangs,
}

/// The in-process link, except that the transfers of one request are broken ([`Fault`]),
/// and a lookup of prefill engine `Q` panics once it was first found pending (a bug in a
/// directory).
struct BrokenTransfers {
    inner: Arc<dyn Link>,
    victim: RequestId,
    fault: Fault,
}

impl BrokenTransfers {
    /// The victim's transfer: a panic, or no answer ever.
    fn broken(&self) -> TransferFuture {
        match self.fault {
            Fault::Hangs => Box::pin(std::future::pending()),
            Fault::Panics => Box::pin(async { panic!("a plane bug") }),
        }
    }
}

impl Link for BrokenTransfers {
    fn me(&self) -> &RankInfo {
        self.inner.me()
    }
    fn send(&self, to: &Peer, id: &RequestId, msg: PeerMessage) -> Result<(), LinkError> {
        self.inner.send(to, id, msg)
    }
    fn siblings(&self) -> Vec<Peer> {
        self.inner.siblings()
    }
    fn resolve(&self, prefill: &EngineId, dp_rank: Option<u32>) -> ResolveFuture {
        if prefill.to_string() == "Q" {
            return Box::pin(async {
                tokio::task::yield_now().await;
                panic!("a directory bug")
            });
        }
        self.inner.resolve(prefill, dp_rank)
    }
    fn write(
        &self,
        id: &RequestId,
        to: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: std::time::Instant,
    ) -> TransferFuture {
        if *id == self.victim {
            return self.broken();
        }
        self.inner.write(id, to, src, dst, deadline)
    }
    fn read(
        &self,
        id: &RequestId,
        from: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: std::time::Instant,
    ) -> TransferFuture {
        if *id == self.victim {
            return self.broken();
        }
        self.inner.read(id, from, src, dst, deadline)
    }
    fn request_ended(&self, id: &RequestId) {
        self.inner.request_ended(id)
    }
    fn detach(&self) {
        self.inner.detach()
    }
    /// A stuck plane is taken as one-sided (a late write or read cannot be refused), whose
    /// every peer could be watched: push stays push, and the blocks are fenced.
    fn one_sided(&self) -> bool {
        self.fault == Fault::Hangs
    }
    fn unwatched(&self, peers: &[Peer]) -> UnwatchedFuture {
        if self.fault == Fault::Hangs {
            return Box::pin(std::future::ready(Vec::new()));
        }
        self.inner.unwatched(peers)
    }
}

struct BrokenAttach {
    fabric: Arc<Fabric>,
    victim: RequestId,
    fault: Fault,
}

impl Attach for BrokenAttach {
    fn attach(
        &self,
        rank: RankInfo,
        role: Role,
        inbox: Inbox,
        region: Arc<Region>,
    ) -> Result<Arc<dyn Link>, Error> {
        let inner = self.fabric.attach(rank, role, inbox, region)?;
        Ok(Arc::new(BrokenTransfers {
            inner,
            victim: self.victim.clone(),
            fault: self.fault,
        }))
    }
}

/// A runtime on the fabric whose transfers for request `bad` are broken by `fault`.
async fn start_broken(
    fabric: &Arc<Fabric>,
    role: Role,
    rank: RankInfo,
    mode: TransferMode,
    fault: Fault,
) -> Runtime {
    let attach = BrokenAttach {
        fabric: fabric.clone(),
        victim: RequestId::new("bad"),
        fault,
    };
    let region = Arc::new(Region::new(BLOCKS, BLOCK_BYTES).unwrap());
    Runtime::builder(role, rank)
        .timeouts(timeouts())
        .mode(mode)
        .transport(TransportChoice::Custom(Arc::new(attach)))
        .region(region)
        .start()
        .await
        .unwrap()
}

/// Prefill `P` and decode `D` on a fabric of their own, their transfers for request `bad`
/// broken ([`start_broken`]).
async fn broken_pair(mode: TransferMode, fault: Fault) -> (Runtime, Runtime) {
    let fabric = Fabric::new();
    let p = start_broken(&fabric, Role::Prefill, rank("P", 0, 1), mode, fault).await;
    let d = start_broken(&fabric, Role::Decode, rank("D", 0, 1), mode, fault).await;
    (p, d)
}

/// A transfer whose future panics (the request actor polls its transfers itself) fails
/// only its request, `Internal`, with its blocks given back once on both sides; the
/// runtime, and the next request, go on.
#[tokio::test(start_paused = true)]
async fn a_transfer_that_panics_fails_only_its_request() {
    for mode in [TransferMode::Push, TransferMode::Pull] {
        let (p, d) = broken_pair(mode, Fault::Panics).await;
        let mut outcomes = (Outcomes::default(), Outcomes::default());
        for (i, id) in ["bad", "good"].into_iter().enumerate() {
            let i = i as u32;
            let s = p.sender(id).unwrap();
            let r = d
                .receiver(id, spec("P", Some(blocks(10 + i * 2..12 + i * 2))))
                .unwrap();
            s.send(blocks(i * 2..i * 2 + 2)).unwrap();
            let (sent, got) = (s.completion().await, r.completion().await);
            if id == "good" {
                assert_eq!((&sent, &got), (&State::Done, &State::Done), "{mode:?}");
            } else {
                // Push: prefill's write panics; pull: decode's read does.
                let (mine, theirs) = match mode {
                    TransferMode::Push => (&sent, &got),
                    TransferMode::Pull => (&got, &sent),
                };
                assert!(
                    matches!(mine, State::Failed(FailureReason::Internal { .. })),
                    "{mode:?}: {mine}"
                );
                assert!(matches!(theirs, State::Failed(_)), "{mode:?}: {theirs}");
            }
        }
        // A reader that died mid-read holds its blocks until the fence bound (as any dead
        // actor whose transfer may still land).
        tokio::time::sleep(timeouts().fence_max() + Duration::from_secs(1)).await;
        settle().await;
        outcomes.0.absorb(p.drain_events());
        outcomes.1.absorb(d.drain_events());
        for (id, i) in [("bad", 0u32), ("good", 1)] {
            assert_eq!(
                outcomes.0.released(id),
                blocks(i * 2..i * 2 + 2),
                "{mode:?}"
            );
            assert_eq!(
                outcomes.1.released(id),
                blocks(10 + i * 2..12 + i * 2),
                "{mode:?}"
            );
        }
    }
}

/// A plane that never answers a transfer (stuck) keeps decode's blocks held past the
/// request's failure at its deadline, for [`PLANE_ANSWER_GRACE`] (the write or read may
/// still land in them), and no longer: then the request actor that posted it reports it
/// unanswered itself (push: prefill then owes decode its `AbortAck`), the blocks go back
/// once, and the actor ends; the next request goes on.
#[tokio::test(start_paused = true)]
async fn a_transfer_its_plane_never_answers_holds_its_blocks_for_the_grace_alone() {
    for mode in [TransferMode::Push, TransferMode::Pull] {
        let (p, d) = broken_pair(mode, Fault::Hangs).await;
        let s = p.sender("bad").unwrap();
        let r = d.receiver("bad", spec("P", Some(blocks(10..12)))).unwrap();
        s.send(blocks(0..2)).unwrap();
        // Push: prefill's write never answers; pull: decode's read does not.
        let poster = match mode {
            TransferMode::Push => s.completion().await,
            TransferMode::Pull => r.completion().await,
        };
        assert_eq!(
            poster,
            State::Failed(FailureReason::TransferTimeout),
            "{mode:?}"
        );
        let failed = tokio::time::Instant::now();
        let mut decode = Outcomes::default();
        tokio::time::sleep(PLANE_ANSWER_GRACE - Duration::from_millis(10)).await;
        settle().await;
        decode.absorb(d.drain_events());
        assert!(matches!(decode.state("bad"), State::Failed(_)), "{mode:?}");
        assert_eq!(decode.released("bad"), vec![], "{mode:?}: released early");
        tokio::time::sleep_until(failed + PLANE_ANSWER_GRACE + Duration::from_millis(10)).await;
        settle().await;
        decode.absorb(d.drain_events());
        assert_eq!(decode.released("bad"), blocks(10..12), "{mode:?}");
        let s = p.sender("good").unwrap();
        let r = d.receiver("good", spec("P", Some(blocks(20..22)))).unwrap();
        s.send(blocks(4..6)).unwrap();
        assert_eq!(
            (s.completion().await, r.completion().await),
            (State::Done, State::Done),
            "{mode:?}"
        );
    }
}

/// A bootstrap lookup that panics after it was first found pending (the request actor polls
/// it as one of its waits, no task of its own) fails its request `Internal` at once, not at
/// the bootstrap deadline, with its blocks given back; the runtime and the next request go
/// on.
#[tokio::test(start_paused = true)]
async fn a_bootstrap_lookup_that_panics_fails_only_its_request() {
    let (p, d) = broken_pair(TransferMode::Push, Fault::Panics).await;
    let started = tokio::time::Instant::now();
    let r = d.receiver("lost", spec("Q", Some(blocks(20..22)))).unwrap();
    let end = r.completion().await;
    assert!(
        matches!(&end, State::Failed(FailureReason::Internal { .. })),
        "{end}"
    );
    assert!(
        started.elapsed() < timeouts().bootstrap,
        "failed at the deadline, not at the panic"
    );
    let s = p.sender("good").unwrap();
    let r = d.receiver("good", spec("P", Some(blocks(10..12)))).unwrap();
    s.send(blocks(0..2)).unwrap();
    assert_eq!(
        (s.completion().await, r.completion().await),
        (State::Done, State::Done)
    );
    settle().await;
    let mut decode = Outcomes::default();
    decode.absorb(d.drain_events());
    assert_eq!(decode.released("lost"), blocks(20..22));
    assert_eq!(decode.released("good"), blocks(10..12));
}

/// Tensor-parallel rank `r` of `size` of `engine`.
fn tp_rank(engine: &str, r: u32, size: u32) -> RankInfo {
    let mut rank = RankInfo::single(engine);
    rank.tp_rank = r;
    rank.tp_size = size;
    rank
}

/// Heterogeneous TP: the bytes of block `block` of a rank holding KV heads from `first`
/// (`held` of them) of a 2-layer model (K and V apart: 4 ranges of one part), heads in
/// `order`, each byte the model's own (range, head, token, byte) value.
fn tp_block(block: BlockId, first: u32, held: u32, order: HeadOrder) -> Vec<u8> {
    const TOKENS: u32 = 4;
    const HEAD_BYTES: u32 = 8;
    let mut out = Vec::new();
    for range in 0..4u32 {
        let mut part = vec![0u8; (held * TOKENS * HEAD_BYTES) as usize];
        for h in 0..held {
            for t in 0..TOKENS {
                for b in 0..HEAD_BYTES {
                    let at = match order {
                        HeadOrder::TokenMajor => (t * held + h) * HEAD_BYTES + b,
                        _ => (h * TOKENS + t) * HEAD_BYTES + b,
                    };
                    let v = ((range * 16 + first + h) * 4 + t) * 8 + b;
                    part[at as usize] = (v as u8) ^ (block.0 as u8).wrapping_mul(29);
                }
            }
        }
        out.extend(part);
    }
    out
}

/// Prefill at TP `prefill_tp` (head-major), decode at TP `decode_tp` (token-major), a model
/// of `kv_heads` KV heads: each decode rank takes its heads from the prefill ranks holding
/// them (gathering from several where decode's TP is smaller, taking a share of one where
/// it is larger, replicas where a TP size exceeds the heads), and every byte of its blocks
/// is the model's; both modes.
async fn decode_ranks_take_their_heads_from_prefills_ranks(
    mode: TransferMode,
    (prefill_tp, decode_tp, kv_heads): (u32, u32, u32),
) {
    let orders = (HeadOrder::HeadMajor, HeadOrder::TokenMajor);
    ranks_take_their_heads(mode, (prefill_tp, decode_tp, kv_heads), orders).await;
}

/// [`decode_ranks_take_their_heads_from_prefills_ranks`] with each side's order of heads
/// (prefill's, decode's): a latent cache (MLA) on both is one head every rank holds.
async fn ranks_take_their_heads(
    mode: TransferMode,
    (prefill_tp, decode_tp, kv_heads): (u32, u32, u32),
    (prefill_order, decode_order): (HeadOrder, HeadOrder),
) {
    let fabric = Fabric::new();
    let layout = |held: u32, order| {
        let mut layout = KvLayout::shaped(KvShape::KvHalves, 2, BLOCKS, (held * 4 * 8) as usize);
        layout.block_tokens = 4;
        layout.heads = Some(KvHeads {
            kv_heads,
            order,
            head_bytes: 8,
        });
        layout
    };
    let heads = |tp: u32, r: u32| handoff_transport::tp::rank_heads(kv_heads, tp, r).unwrap();
    let mut prefill = Vec::new();
    for r in 0..prefill_tp {
        let held = heads(prefill_tp, r).len() as u32;
        let rank = tp_rank("P", r, prefill_tp);
        let p = start_laid_out(
            &fabric,
            Role::Prefill,
            rank,
            mode,
            layout(held, prefill_order),
        )
        .await;
        prefill.push(p);
    }
    let mut decode = Vec::new();
    for r in 0..decode_tp {
        let held = heads(decode_tp, r).len() as u32;
        let rank = tp_rank("D", r, decode_tp);
        decode.push(
            start_laid_out(
                &fabric,
                Role::Decode,
                rank,
                mode,
                layout(held, decode_order),
            )
            .await,
        );
    }
    let (src, dst) = (blocks(5..9), blocks(30..34));
    for (r, p) in prefill.iter().enumerate() {
        let mine = heads(prefill_tp, r as u32);
        for b in &src {
            let bytes = tp_block(*b, mine.start, mine.len() as u32, prefill_order);
            p.region().write_block(*b, &bytes).unwrap();
        }
    }
    let receivers: Vec<_> = decode
        .iter()
        .map(|d| d.receiver("r", spec("P", Some(dst.clone()))).unwrap())
        .collect();
    let senders: Vec<_> = prefill.iter().map(|p| p.sender("r").unwrap()).collect();
    for s in &senders {
        s.send(src.clone()).unwrap();
    }
    for r in &receivers {
        assert_eq!(r.completion().await, State::Done, "{mode:?}");
    }
    for s in &senders {
        assert_eq!(s.completion().await, State::Done, "{mode:?}");
    }
    for (r, d) in decode.iter().enumerate() {
        let mine = heads(decode_tp, r as u32);
        for (from, to) in src.iter().zip(&dst) {
            assert_eq!(
                d.region().read_block(*to).unwrap(),
                tp_block(*from, mine.start, mine.len() as u32, decode_order),
                "{mode:?}: decode rank {r}, {to}"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn prefill_tp4_pushes_each_decode_tp2_rank_its_heads() {
    decode_ranks_take_their_heads_from_prefills_ranks(TransferMode::Push, (4, 2, 8)).await;
}

#[tokio::test(start_paused = true)]
async fn decode_tp2_pulls_its_heads_from_prefill_tp4() {
    decode_ranks_take_their_heads_from_prefills_ranks(TransferMode::Pull, (4, 2, 8)).await;
}

/// Fan-out: one prefill rank serves both decode ranks, each its half of the heads.
#[tokio::test(start_paused = true)]
async fn prefill_tp1_pushes_each_decode_tp2_rank_its_half_of_the_heads() {
    decode_ranks_take_their_heads_from_prefills_ranks(TransferMode::Push, (1, 2, 8)).await;
}

#[tokio::test(start_paused = true)]
async fn decode_tp4_ranks_pull_their_heads_from_prefill_tp2() {
    decode_ranks_take_their_heads_from_prefills_ranks(TransferMode::Pull, (2, 4, 8)).await;
}

/// Fan-out with replicated heads: 2 KV heads, decode TP 4 holds each on two ranks, and
/// each prefill rank (one head each) serves the two decode ranks holding its head.
#[tokio::test(start_paused = true)]
async fn replicated_decode_heads_are_read_from_the_prefill_rank_holding_them() {
    for mode in [TransferMode::Push, TransferMode::Pull] {
        decode_ranks_take_their_heads_from_prefills_ranks(mode, (2, 4, 2)).await;
    }
}

/// Latent attention (MLA): one latent row per token, the same on every rank; each decode
/// rank reads its whole block from one prefill rank, in both directions.
#[tokio::test(start_paused = true)]
async fn latent_caches_are_read_whole_from_one_prefill_rank_between_tp_sizes() {
    let latent = (HeadOrder::Latent, HeadOrder::Latent);
    for mode in [TransferMode::Push, TransferMode::Pull] {
        for sizes in [(2, 1), (1, 2), (4, 2), (2, 4)] {
            ranks_take_their_heads(mode, (sizes.0, sizes.1, 1), latent).await;
        }
    }
}

/// TP sizes neither of which divides the other are refused by name, before a byte moves;
/// so is a pair of TP sizes whose layouts do not say how they hold heads.
#[tokio::test(start_paused = true)]
async fn tp_pairings_not_supported_fail_by_name() {
    let fabric = Fabric::new();
    let mode = TransferMode::Push;
    let plain = || KvLayout::shaped(KvShape::KvHalves, 2, BLOCKS, 64);
    let mut prefill = Vec::new();
    for r in 0..2 {
        prefill
            .push(start_laid_out(&fabric, Role::Prefill, tp_rank("P", r, 2), mode, plain()).await);
    }
    let d = start_laid_out(&fabric, Role::Decode, tp_rank("D", 1, 3), mode, plain()).await;
    let r = d.receiver("up", spec("P", Some(blocks(0..2)))).unwrap();
    match r.completion().await {
        State::Failed(FailureReason::Protocol { detail }) => {
            assert!(detail.contains("neither divides"), "{detail}")
        }
        other => panic!("decode tp 3 against prefill tp 2: {other:?}"),
    }
    // Prefill TP 2 without head information, decode TP 1: the pairing is refused.
    let fabric = Fabric::new();
    let p0 = start_laid_out(&fabric, Role::Prefill, tp_rank("P", 0, 2), mode, plain()).await;
    let _p1 = start_laid_out(&fabric, Role::Prefill, tp_rank("P", 1, 2), mode, plain()).await;
    let d = start_laid_out(&fabric, Role::Decode, tp_rank("D", 0, 1), mode, plain()).await;
    let r = d.receiver("heads", spec("P", Some(blocks(0..2)))).unwrap();
    let s = p0.sender("heads").unwrap();
    s.send(blocks(0..2)).unwrap();
    // Whichever side checks first fails it by name; the other hears why.
    match r.completion().await {
        State::Failed(
            FailureReason::Protocol { detail } | FailureReason::AbortedByPeer { cause: detail, .. },
        ) => assert!(detail.contains("without its KV heads"), "{detail}"),
        other => panic!("no head information: {other:?}"),
    }
    assert!(matches!(s.completion().await, State::Failed(_)));
}

/// Fan-out failure (seed 003 with one prefill rank serving two decode ranks): prefill holds
/// its blocks and decode rank 0 has paired; decode rank 1's engine aborts as it opens.
/// Prefill fails at once and tells decode rank 0, which fails too instead of waiting out
/// its deadline; every side gives its blocks back exactly once.
#[tokio::test(start_paused = true)]
async fn one_decode_rank_of_two_aborting_fails_the_request_on_every_rank() {
    for mode in [TransferMode::Push, TransferMode::Pull] {
        let fabric = Fabric::new();
        let layout = |held: u32| {
            let mut layout =
                KvLayout::shaped(KvShape::KvHalves, 2, BLOCKS, (held * 4 * 8) as usize);
            layout.block_tokens = 4;
            layout.heads = Some(KvHeads {
                kv_heads: 4,
                order: HeadOrder::HeadMajor,
                head_bytes: 8,
            });
            layout
        };
        let p = start_laid_out(&fabric, Role::Prefill, tp_rank("P", 0, 1), mode, layout(4)).await;
        let d0 = start_laid_out(&fabric, Role::Decode, tp_rank("D", 0, 2), mode, layout(2)).await;
        let d1 = start_laid_out(&fabric, Role::Decode, tp_rank("D", 1, 2), mode, layout(2)).await;
        let s = p.sender("r").unwrap();
        s.send(blocks(8..10)).unwrap();
        let r0 = d0.receiver("r", spec("P", Some(blocks(0..2)))).unwrap();
        settle().await;
        assert_eq!(
            s.poll(),
            State::Bootstrapping,
            "{mode:?}: one decode rank of two"
        );
        let t0 = tokio::time::Instant::now();
        let r1 = d1.receiver("r", spec("P", Some(blocks(4..6)))).unwrap();
        r1.abort();
        assert!(matches!(s.completion().await, State::Failed(_)), "{mode:?}");
        match r0.completion().await {
            State::Failed(FailureReason::AbortedByPeer { .. }) => {}
            other => panic!("{mode:?}: decode rank 0 ended {other}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "{mode:?}: decode rank 0 waited out a deadline"
        );
        settle().await;
        let (mut op, mut o0, mut o1) = (
            Outcomes::default(),
            Outcomes::default(),
            Outcomes::default(),
        );
        op.absorb(p.drain_events());
        o0.absorb(d0.drain_events());
        o1.absorb(d1.drain_events());
        assert_eq!(op.released("r"), blocks(8..10), "{mode:?}");
        assert_eq!(o0.released("r"), blocks(0..2), "{mode:?}");
        assert_eq!(o1.released("r"), blocks(4..6), "{mode:?}");
    }
}
