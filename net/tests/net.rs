//! The network transport on loopback: real ZMTP sockets between runtimes in this process,
//! and raw peers that misbehave. The data plane here moves nothing (these tests are about
//! control messages and liveness; data moves in the data-plane and multi-process tests).

use std::sync::Arc;
use std::time::Duration;

use handoff_actors::link::{TransferError, TransferFuture};
use handoff_actors::{
    BlockId, EngineId, FailureReason, RankInfo, ReceiverSpec, Region, Role, Runtime, State,
    Timeouts, TransportChoice,
};
use handoff_net::{
    DataPlane, Directory, GrantTable, NetConfig, NetTransport, PlaneTransfer, StaticDirectory,
};
use handoff_transport::wire;
use handoff_transport::wire::messages::{
    Heartbeat, Hello, HelloAck, LayoutDescriptor, Message, TransportKind, WorkerRecord,
};
use handoff_transport::zmtp::{Dealer, Router, RouterEvent};

/// A data plane that says so when asked to move bytes: for control-plane tests only.
#[derive(Default)]
struct NoData(Arc<GrantTable>);

impl DataPlane for NoData {
    fn name(&self) -> &'static str {
        "none"
    }

    fn descriptor(&self) -> LayoutDescriptor {
        let layout = handoff_transport::KvLayout::contiguous(
            0x1000,
            256,
            4096,
            handoff_transport::KvMemory::Host,
        );
        LayoutDescriptor::of(TransportKind::Tcp, "none".into(), &layout)
    }
    fn address(&self) -> String {
        "none".into()
    }
    fn grants(&self) -> &Arc<GrantTable> {
        &self.0
    }
    fn write(&self, _: PlaneTransfer<'_>) -> TransferFuture {
        Box::pin(async {
            Err(TransferError::Simulated {
                detail: "this test moves no data".into(),
            })
        })
    }
    fn read(&self, _: PlaneTransfer<'_>) -> TransferFuture {
        Box::pin(async {
            Err(TransferError::Simulated {
                detail: "this test moves no data".into(),
            })
        })
    }
}

fn net_cfg() -> NetConfig {
    NetConfig {
        heartbeat_interval: Duration::from_millis(100),
        heartbeats_missed_max: 3,
        connect_timeout: Duration::from_secs(2),
        ..NetConfig::default()
    }
}

fn timeouts() -> Timeouts {
    Timeouts {
        bootstrap: Duration::from_secs(20),
        waiting: Duration::from_secs(20),
        transfer: Duration::from_secs(5),
        pull_ttl: Duration::from_secs(20),
    }
}

async fn worker(
    dir: &Arc<StaticDirectory>,
    role: Role,
    engine: &str,
    admission: Option<usize>,
) -> Runtime {
    let rank = RankInfo::single(engine);
    let transport = NetTransport::bind(
        net_cfg(),
        rank.clone(),
        role,
        dir.clone(),
        Arc::new(NoData::default()),
    )
    .await
    .unwrap();
    Runtime::builder(role, rank)
        .timeouts(timeouts())
        .admission(admission)
        .transport(TransportChoice::Custom(Arc::new(transport)))
        .region(Arc::new(Region::new(256, 4096).unwrap()))
        .start()
        .await
        .unwrap()
}

fn spec(prefill: &str, blocks: Option<Vec<BlockId>>) -> ReceiverSpec {
    ReceiverSpec {
        prefill: EngineId::new(prefill),
        prefill_dp_rank: None,
        blocks,
    }
}

const T: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturated_decode_rejects_over_the_network_and_prefill_fails_in_milliseconds() {
    let dir = Arc::new(StaticDirectory::new());
    let p = worker(&dir, Role::Prefill, "P", None).await;
    let d = worker(&dir, Role::Decode, "D", Some(0)).await;
    let s = p.sender("r").unwrap();
    s.send(vec![BlockId(1)]).unwrap();
    let t0 = std::time::Instant::now();
    let r = d.receiver("r", spec("P", None)).unwrap();
    assert_eq!(
        tokio::time::timeout(T, r.completion()).await.unwrap(),
        State::Failed(FailureReason::RejectedBusy)
    );
    assert_eq!(
        tokio::time::timeout(T, s.completion()).await.unwrap(),
        State::Failed(FailureReason::RejectedBusy)
    );
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "prefill heard of the rejection after {took:?}"
    );
    eprintln!("rejection reached prefill in {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_fails_the_requests_that_depend_on_it_at_once() {
    let dir = Arc::new(StaticDirectory::new());
    let p = worker(&dir, Role::Prefill, "P", None).await;
    let d = worker(&dir, Role::Decode, "D", None).await;
    let r = d.receiver("r", spec("P", Some(vec![BlockId(0)]))).unwrap();
    // Wait until decode's transfer info reached prefill (the request is buffered there).
    tokio::time::timeout(T, async {
        while r.poll() != State::WaitingForInput {
            tokio::time::sleep(Duration::from_millis(5)).await
        }
    })
    .await
    .unwrap();
    let t0 = std::time::Instant::now();
    p.shutdown().await;
    let end = tokio::time::timeout(T, r.completion()).await.unwrap();
    assert!(
        matches!(end, State::Failed(FailureReason::PeerLost { .. })),
        "{end}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "noticed after {:?}",
        t0.elapsed()
    );
}

/// A prefill that died and came back (same rank, new incarnation): the first request to the
/// new one reaches it, instead of failing as "lost" when its hello shows the new incarnation
/// (what depended on the old one already failed when it was lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_serves_new_requests_after_its_old_incarnation_was_lost() {
    let dir = Arc::new(StaticDirectory::new());
    let p = worker(&dir, Role::Prefill, "P", None).await;
    let d = worker(&dir, Role::Decode, "D", None).await;
    let r = d.receiver("r1", spec("P", Some(vec![BlockId(0)]))).unwrap();
    tokio::time::timeout(T, async {
        while r.poll() != State::WaitingForInput {
            tokio::time::sleep(Duration::from_millis(5)).await
        }
    })
    .await
    .unwrap();
    p.shutdown().await;
    let end = tokio::time::timeout(T, r.completion()).await.unwrap();
    assert!(
        matches!(end, State::Failed(FailureReason::PeerLost { .. })),
        "{end}"
    );

    let p2 = worker(&dir, Role::Prefill, "P", None).await;
    let s = p2.sender("r2").unwrap();
    s.send(vec![BlockId(1)]).unwrap();
    let r2 = d.receiver("r2", spec("P", Some(vec![BlockId(2)]))).unwrap();
    // This test's data plane moves nothing, so prefill's write fails and it aborts: what
    // matters is that the request reached the new incarnation and ended by its word.
    let end = tokio::time::timeout(T, r2.completion()).await.unwrap();
    assert!(
        matches!(end, State::Failed(FailureReason::AbortedByPeer { .. })),
        "the new incarnation was not reached: {end}"
    );
}

/// A prefill that connects, says hello, then goes silent (hung, partitioned): decode loses
/// it at the heartbeat deadline, not at the request's own timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_lost_after_its_missed_heartbeats() {
    let dir = Arc::new(StaticDirectory::new());
    let mut fake = Router::bind("tcp://127.0.0.1:0").await.unwrap();
    let fake_rank = RankInfo::single("P");
    dir.insert(WorkerRecord {
        rank: fake_rank.clone(),
        role: Role::Prefill,
        incarnation: 1,
        control_address: format!("tcp://{}", fake.local_addr()),
        data_address: "none".into(),
        data_descriptor: vec![],
    });
    let d = worker(&dir, Role::Decode, "D", None).await;
    let r = d.receiver("r", spec("P", Some(vec![BlockId(0)]))).unwrap();
    // Answer the hello, then say nothing more.
    let answered = async {
        loop {
            if let Some(RouterEvent::Message { conn, frames, .. }) = fake.recv().await {
                if let Ok(Message::Hello(_)) = wire::decode(&frames[0], None) {
                    let ack = wire::encode(&Message::HelloAck(HelloAck::new(1)), None).unwrap();
                    fake.send(conn, vec![ack]).unwrap();
                    return;
                }
            }
        }
    };
    tokio::time::timeout(T, answered).await.unwrap();
    let t0 = std::time::Instant::now();
    let end = tokio::time::timeout(T, r.completion()).await.unwrap();
    assert!(
        matches!(end, State::Failed(FailureReason::PeerLost { .. })),
        "{end}"
    );
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(2),
        "lost after {took:?} (lease 300 ms)"
    );
    drop(fake);
}

/// A prefill worker "P" and its control address, for a test that speaks the protocol
/// to it by hand.
async fn prefill_at_its_address() -> (Runtime, String) {
    let (p, addr, _) = prefill_in(Arc::new(StaticDirectory::new())).await;
    (p, addr)
}

/// A prefill worker "P" registered in `dir` (default timeouts): its runtime, control address
/// and incarnation.
async fn prefill_in(dir: Arc<dyn Directory>) -> (Runtime, String, u64) {
    let rank = RankInfo::single("P");
    let transport = NetTransport::bind(
        net_cfg(),
        rank.clone(),
        Role::Prefill,
        dir,
        Arc::new(NoData::default()),
    )
    .await
    .unwrap();
    let addr = transport.control_address().to_string();
    let incarnation = transport.incarnation();
    let p = Runtime::builder(Role::Prefill, rank)
        .transport(TransportChoice::Custom(Arc::new(transport)))
        .region(Arc::new(Region::new(16, 4096).unwrap()))
        .start()
        .await
        .unwrap();
    (p, addr, incarnation)
}

/// A peer on another protocol version is refused at hello, by name, and the worker goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_on_another_protocol_version_is_refused_by_name() {
    let (p, addr) = prefill_at_its_address().await;
    let mut dealer = Dealer::connect(&addr, b"", T).await.unwrap();
    let mut hello = Hello::new(Role::Decode, RankInfo::single("D"), 7);
    hello.protocol_version = 99;
    dealer
        .send(vec![wire::encode(&Message::Hello(hello), None).unwrap()])
        .unwrap();
    let reply = tokio::time::timeout(T, dealer.recv())
        .await
        .unwrap()
        .unwrap();
    let Message::ProtocolError(e) = wire::decode(&reply[0], None).unwrap() else {
        panic!("expected ProtocolError")
    };
    assert!(
        e.detail.contains("99")
            && e.detail
                .contains(&handoff_transport::PROTOCOL_VERSION.to_string()),
        "{}",
        e.detail
    );
    // Counted for operators, by cause.
    let metrics = p.metrics().encode();
    assert!(
        metrics.contains(r#"handoff_frames_refused_total{cause="version"} 1"#),
        "{metrics}"
    );
    // The worker still serves a well-behaved peer.
    let mut ok = Dealer::connect(&addr, b"", T).await.unwrap();
    ok.send(vec![wire::encode(
        &Message::Hello(Hello::new(Role::Decode, RankInfo::single("D"), 8)),
        None,
    )
    .unwrap()])
        .unwrap();
    let reply = tokio::time::timeout(T, ok.recv()).await.unwrap().unwrap();
    assert!(matches!(
        wire::decode(&reply[0], None).unwrap(),
        Message::HelloAck(_)
    ));
    p.shutdown().await;
}

/// A process of a rank older than the one that holds it now (stopped, replaced by a
/// restart, then resumed) is refused at hello, by name: it must neither displace its
/// successor (whose requests would fail as "restarted") nor answer for it. A newer one is
/// taken as a restart, as before. What the refused process sent behind its hello (its
/// heartbeats, queued while it was stopped) is dropped unread: not refused again, one by
/// one, and counted as malformed frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_process_of_a_rank_is_refused_after_a_newer_one_took_it() {
    let (p, addr) = prefill_at_its_address().await;
    let hello = |incarnation: u64| {
        let hello = Hello::new(Role::Decode, RankInfo::single("D"), incarnation);
        vec![wire::encode(&Message::Hello(hello), None).unwrap()]
    };
    let answer = |reply: Vec<Vec<u8>>| wire::decode(&reply[0], None).unwrap();
    let mut newer = Dealer::connect(&addr, b"", T).await.unwrap();
    newer.send(hello(20)).unwrap();
    let reply = tokio::time::timeout(T, newer.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(answer(reply), Message::HelloAck(_)));
    let mut older = Dealer::connect(&addr, b"", T).await.unwrap();
    older.send(hello(10)).unwrap();
    for seq in 1..=3 {
        let beat = Message::Heartbeat(Heartbeat {
            incarnation: 10,
            seq,
            echo: 0,
            lease_ms: 0,
        });
        older
            .send(vec![wire::encode(&beat, None).unwrap()])
            .unwrap();
    }
    let reply = tokio::time::timeout(T, older.recv())
        .await
        .unwrap()
        .unwrap();
    let Message::ProtocolError(e) = answer(reply) else {
        panic!("an older process was taken")
    };
    assert!(
        e.detail.contains("10") && e.detail.contains("20") && e.detail.contains("older"),
        "{}",
        e.detail
    );
    // A newer one still takes the rank (its hello, answered, comes after the older
    // connection's heartbeats were read).
    let mut newest = Dealer::connect(&addr, b"", T).await.unwrap();
    newest.send(hello(30)).unwrap();
    let reply = tokio::time::timeout(T, newest.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(answer(reply), Message::HelloAck(_)));
    let metrics = p.metrics().encode();
    assert!(
        metrics.contains(r#"handoff_frames_refused_total{cause="stale_incarnation"} 1"#),
        "{metrics}"
    );
    assert!(
        !metrics.contains(r#"handoff_frames_refused_total{cause="unexpected"}"#),
        "the refused process's heartbeats were counted as malformed: {metrics}"
    );
    p.shutdown().await;
}

/// Seed 003 over the network: two pipeline ranks of prefill, decode saturated (it opens
/// the request without blocks). The rank whose bootstrap deadline passes first fails the
/// request; its sibling hears it as a message and fails at once instead of at its own
/// deadline; decode hears it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_siblings_fail_together_over_the_network() {
    let dir = Arc::new(StaticDirectory::new());
    let short = Timeouts {
        bootstrap: Duration::from_millis(600),
        ..timeouts()
    };
    let mut prefill = Vec::new();
    for pp in 0..2 {
        let mut rank = RankInfo::single("P");
        rank.pp_rank = pp;
        rank.pp_size = 2;
        let transport = NetTransport::bind(
            net_cfg(),
            rank.clone(),
            Role::Prefill,
            dir.clone(),
            Arc::new(NoData::default()),
        )
        .await
        .unwrap();
        let rt = Runtime::builder(Role::Prefill, rank)
            .timeouts(if pp == 0 { short } else { timeouts() })
            .transport(TransportChoice::Custom(Arc::new(transport)))
            .region(Arc::new(Region::new(16, 4096).unwrap()))
            .start()
            .await
            .unwrap();
        prefill.push(rt);
    }
    let d = worker(&dir, Role::Decode, "D", None).await;
    tokio::time::sleep(Duration::from_millis(200)).await; // siblings find each other
    let s0 = prefill[0].sender("r").unwrap();
    let s1 = prefill[1].sender("r").unwrap();
    s0.send(vec![BlockId(1)]).unwrap();
    s1.send(vec![BlockId(2)]).unwrap();
    let r = d.receiver("r", spec("P", None)).unwrap();
    assert_eq!(
        tokio::time::timeout(T, s0.completion()).await.unwrap(),
        State::Failed(FailureReason::BootstrapTimeout)
    );
    let t0 = std::time::Instant::now();
    let second = tokio::time::timeout(T, s1.completion()).await.unwrap();
    assert!(
        matches!(second, State::Failed(FailureReason::AbortedByPeer { .. })),
        "{second}"
    );
    let on_decode = tokio::time::timeout(T, r.completion()).await.unwrap();
    assert!(
        matches!(
            on_decode,
            State::Failed(FailureReason::AbortedByPeer { .. })
        ),
        "{on_decode}"
    );
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
}

/// Garbage on a worker's control port costs that connection only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_control_port_costs_one_connection() {
    let dir = Arc::new(StaticDirectory::new());
    let p = worker(&dir, Role::Prefill, "P", None).await;
    let d = worker(&dir, Role::Decode, "D", Some(0)).await;
    let records = handoff_net::Directory::lookup(&*dir, &EngineId::new("P"))
        .await
        .unwrap();
    let addr = records[0].control_address.clone();
    for junk in [
        vec![0u8; 3],
        b"HDOF\x01\x00\xff\xff".to_vec(),
        vec![0xAB; 5000],
    ] {
        let mut dealer = Dealer::connect(&addr, b"", T).await.unwrap();
        dealer.send(vec![junk]).unwrap();
        let reply = tokio::time::timeout(T, dealer.recv()).await.unwrap();
        if let Some(frames) = reply {
            assert!(matches!(
                wire::decode(&frames[0], None),
                Ok(Message::ProtocolError(_))
            ));
        }
    }
    // Still serving: a rejection still flows end to end.
    let s = p.sender("after").unwrap();
    let r = d.receiver("after", spec("P", None)).unwrap();
    assert_eq!(
        tokio::time::timeout(T, r.completion()).await.unwrap(),
        State::Failed(FailureReason::RejectedBusy)
    );
    assert_eq!(
        tokio::time::timeout(T, s.completion()).await.unwrap(),
        State::Failed(FailureReason::RejectedBusy)
    );
}

/// A peer whose first connection goes unanswered (a process starved of its core for
/// seconds, seen with four vLLM servers on two cores) is dialed again, not taken as lost:
/// the request reaches it. Here a proxy in front of the real prefill holds the first
/// connection silently and forwards every later one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_leaves_one_dial_unanswered_is_dialed_again_not_lost() {
    use handoff_net::Directory as _;
    let dir = Arc::new(StaticDirectory::new());
    let p = worker(&dir, Role::Prefill, "P", None).await;
    let mut record = dir.lookup(&EngineId::new("P")).await.unwrap().remove(0);
    let real = record
        .control_address
        .trim_start_matches("tcp://")
        .to_string();
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    record.control_address = format!("tcp://{}", proxy.local_addr().unwrap());
    dir.insert(record);
    let (held_tx, mut held_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((mut client, _)) = proxy.accept().await {
            if std::mem::take(&mut first) {
                let _ = held_tx.send(client); // accepted, never answered
                continue;
            }
            let real = real.clone();
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(real).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    let d = worker(&dir, Role::Decode, "D", None).await;
    let s = p.sender("r").unwrap();
    s.send(vec![BlockId(1)]).unwrap();
    let r = d.receiver("r", spec("P", Some(vec![BlockId(0)]))).unwrap();
    // The first dial was held (and with it, 2 s of connect timeout) ...
    let _held = tokio::time::timeout(T, held_rx.recv()).await.unwrap();
    // ... the second reached prefill, which wrote (and this plane moves nothing): the
    // request fails for the transfer, not for a lost peer.
    let end = tokio::time::timeout(T, r.completion()).await.unwrap();
    assert!(end.to_string().contains("this test moves no data"), "{end}");
    assert!(
        !matches!(s.poll(), State::Bootstrapping),
        "prefill never heard decode: {}",
        s.poll()
    );
}

/// A worker whose rank a newer process takes (it was stopped, say, and a supervisor started
/// another in its place) hears it from the bootstrap server, which closes the replaced
/// registration's connection so that registering again meets the newer record. Its open
/// requests then fail `Superseded` at once, not at their deadlines (nothing would pair
/// with them: new requests find the newer process, and peers that know it refuse this
/// one), and a request opened afterwards is refused by the same name. The newer process
/// goes on as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_rank_a_newer_process_takes_fails_its_requests_superseded() {
    use handoff_bootstrap::{serve, BootstrapClient, ClientConfig, ServerConfig};
    let server = serve(ServerConfig::new("tcp://127.0.0.1:0")).await.unwrap();
    let client = ClientConfig {
        heartbeat_interval: Duration::from_millis(100),
        attempt_timeout: Duration::from_millis(500),
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        ..ClientConfig::default()
    };
    let start = || {
        prefill_in(Arc::new(BootstrapClient::new(
            &server.address(),
            None,
            client,
        )))
    };
    let (old, _, _) = start().await;
    let waiting = old.sender("r").unwrap();
    waiting.send(vec![BlockId(1)]).unwrap();
    let (newer, _, incarnation) = start().await;
    let end = tokio::time::timeout(T, waiting.completion())
        .await
        .expect("failed long before its 300 s bootstrap deadline");
    let State::Failed(FailureReason::Superseded { detail }) = &end else {
        panic!("expected superseded, got {end:?}");
    };
    assert!(detail.contains(&incarnation.to_string()), "{detail}");
    // The failure and the runtime's own word come from the same decision, the failure last.
    assert_eq!(old.superseded().as_deref(), Some(detail.as_str()));
    assert_eq!(
        newer.superseded(),
        None,
        "the newer process is not superseded"
    );
    let says = |rt: &Runtime, line: &str| rt.metrics().encode().lines().any(|l| l == line);
    assert!(says(&old, "handoff_superseded 1"));
    assert!(says(&newer, "handoff_superseded 0"));
    let late = old.sender("r2").unwrap();
    assert_eq!(
        tokio::time::timeout(T, late.completion()).await.unwrap(),
        end,
        "a request opened after is refused the same way"
    );
    let fresh = newer.sender("r3").unwrap();
    assert!(!fresh.poll().is_terminal(), "{:?}", fresh.poll());
    old.shutdown().await;
    newer.shutdown().await;
    server.stop().await;
}
