//! The bootstrap server and client over real sockets on 127.0.0.1: registration rules,
//! queries, liveness, retries under deadlines, authentication, and hostile input.
//!
//! Real time, short intervals: every test finishes in a few seconds.

use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use handoff_bootstrap::status::{render_table, status_json};
use handoff_bootstrap::{
    serve, BootstrapClient, BootstrapError, BootstrapServer, ClientConfig, Key, QueryAnswer,
    ServerConfig,
};
use handoff_transport::wire::{self, Message, ProtocolError, Query};
use handoff_transport::zmtp::Dealer;
use handoff_transport::{EngineId, FailureReason, RankInfo, Role};

mod common;

use common::record;

const T: Duration = Duration::from_secs(5);
/// Scheduling slack allowed past a deadline.
const SLACK: Duration = Duration::from_millis(300);

fn fast() -> ClientConfig {
    ClientConfig {
        heartbeat_interval: Duration::from_millis(100),
        attempt_timeout: Duration::from_millis(500),
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        lost_kept: handoff_bootstrap::LOST_KEPT_DEFAULT,
    }
}

async fn server() -> BootstrapServer {
    serve(ServerConfig::new("tcp://127.0.0.1:0"))
        .await
        .unwrap_or_else(|e| panic!("server starts: {e}"))
}

fn soon() -> Instant {
    Instant::now() + T
}

fn client(server: &BootstrapServer) -> BootstrapClient {
    BootstrapClient::new(&server.address(), None, fast())
}

/// A port nothing listens on (bound, then released).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_then_query_returns_every_worker_once_the_engine_is_complete() {
    let server = server().await;
    let c = client(&server);
    let e = EngineId::new("p");
    c.register(record("p", (0, 1), (0, 2), 1), soon())
        .await
        .expect("rank 0 registers");
    assert_eq!(
        server.query(&e).await.expect("query"),
        QueryAnswer::NotReady {
            registered: vec![handoff_transport::Rank {
                dp: 0,
                tp: 0,
                pp: 0
            }],
            expected: 2
        }
    );
    let other = client(&server);
    other
        .register(record("p", (0, 1), (1, 2), 1), soon())
        .await
        .expect("rank 1 registers");
    let workers = c.query(&e, soon()).await.expect("complete engine");
    assert_eq!(
        workers,
        vec![
            record("p", (0, 1), (0, 2), 1),
            record("p", (0, 1), (1, 2), 1)
        ]
    );
    assert_eq!(c.cached(&e), Some(workers));
    let status = c.status(soon()).await.expect("status");
    assert_eq!(status.engines.len(), 1);
    assert_eq!(status.engines[0].workers.len(), 2);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_the_same_record_twice_is_fine() {
    let server = server().await;
    let c = client(&server);
    let r = record("p", (0, 1), (0, 1), 7);
    c.register(r.clone(), soon()).await.expect("first");
    c.register(r.clone(), soon()).await.expect("same again");
    client(&server)
        .register(r.clone(), soon())
        .await
        .expect("same again from another connection");
    assert_eq!(
        server.query(&EngineId::new("p")).await.expect("query"),
        QueryAnswer::Ready { workers: vec![r] }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflicting_registration_is_a_named_error_and_the_original_is_kept() {
    let server = server().await;
    let original = record("p", (0, 2), (0, 1), 3);
    client(&server)
        .register(original.clone(), soon())
        .await
        .expect("original");
    let mut moved = original.clone();
    moved.control_address = "tcp://10.9.9.9:5000".into();
    let started = Instant::now();
    let err = client(&server)
        .register(moved, soon())
        .await
        .expect_err("same rank and incarnation, other address");
    assert!(started.elapsed() < Duration::from_secs(1), "not retried");
    match &err {
        BootstrapError::Conflict { address, existing } => {
            assert_eq!(address, &server.address());
            assert_eq!(**existing, original);
        }
        other => panic!("expected Conflict, got {other:?}"),
    }
    assert!(err.to_string().contains("10.0.0.0:5000"), "{err}");
    // Other sizes for the same engine conflict with the rank already held.
    let err = client(&server)
        .register(record("p", (1, 4), (0, 1), 3), soon())
        .await
        .expect_err("other dp size");
    assert!(matches!(err, BootstrapError::Conflict { .. }), "{err:?}");
    // An older incarnation of the same rank is refused too.
    let err = client(&server)
        .register(record("p", (0, 2), (0, 1), 2), soon())
        .await
        .expect_err("older incarnation");
    assert!(matches!(err, BootstrapError::Conflict { .. }), "{err:?}");
    let status = server.status().await.expect("status");
    assert_eq!(status.engines[0].workers.len(), 1);
    assert_eq!(status.engines[0].workers[0].incarnation, 3);
    assert_eq!(
        status.engines[0].workers[0].control_address,
        original.control_address
    );
}

/// A restart's registration replaces the old record; the old process, if it runs on (it
/// was stopped, then resumed), hears that its rank is held by a newer one: the server
/// closes its connection, and its registration again meets the conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_with_a_new_incarnation_replaces_its_record() {
    let server = server().await;
    let first = record("p", (0, 1), (0, 1), 1);
    let old = client(&server);
    old.register(first.clone(), soon())
        .await
        .expect("first life");
    let superseded = old.superseded(&first.rank, first.incarnation);
    let mut second = record("p", (0, 1), (0, 1), 2);
    second.control_address = "tcp://10.1.1.1:5001".into();
    client(&server)
        .register(second.clone(), soon())
        .await
        .expect("second life replaces the first");
    assert_eq!(
        server.query(&EngineId::new("p")).await.expect("query"),
        QueryAnswer::Ready {
            workers: vec![second.clone()]
        }
    );
    let holder = tokio::time::timeout(T, superseded)
        .await
        .expect("the old process hears it within a few heartbeats");
    assert_eq!(holder, second);
    // Asked afterwards, it answers at once; another incarnation was not superseded.
    let again = old.superseded(&first.rank, first.incarnation);
    assert_eq!(
        tokio::time::timeout(SLACK, again).await.ok(),
        Some(second.clone())
    );
    let other = old.superseded(&first.rank, 2);
    assert!(tokio::time::timeout(SLACK, other).await.is_err());
    // And the new record stays: the old one's registration again changed nothing.
    assert_eq!(
        server.query(&EngineId::new("p")).await.expect("query"),
        QueryAnswer::Ready {
            workers: vec![second]
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_non_zero_based_dp_ranks_complete_the_engine() {
    let server = server().await;
    let c = client(&server);
    let e = EngineId::new("p");
    c.register(record("p", (2, 2), (0, 1), 1), soon())
        .await
        .expect("dp rank 2");
    assert!(matches!(
        server.query(&e).await.expect("query"),
        QueryAnswer::NotReady { expected: 2, .. }
    ));
    client(&server)
        .register(record("p", (5, 2), (0, 1), 1), soon())
        .await
        .expect("dp rank 5");
    let workers = c.query(&e, soon()).await.expect("ready");
    let dp: Vec<u32> = workers.iter().map(|w| w.rank.dp_rank).collect();
    assert_eq!(dp, vec![2, 5]);
    // A third distinct rank for a 2-rank engine is refused by name.
    let err = client(&server)
        .register(record("p", (7, 2), (0, 1), 1), soon())
        .await
        .expect_err("engine already complete");
    match err {
        BootstrapError::Refused { detail, .. } => assert!(detail.contains("all its 2 ranks")),
        other => panic!("expected Refused, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_on_an_empty_or_incomplete_registry_fail_by_name_within_the_deadline() {
    let server = server().await;
    let e = EngineId::new("nobody");
    assert_eq!(
        server.query(&e).await.expect("query"),
        QueryAnswer::UnknownEngine
    );
    let c = client(&server);
    let deadline = Instant::now() + Duration::from_millis(300);
    let err = c.query(&e, deadline).await.expect_err("unknown engine");
    assert!(
        Instant::now() < deadline + SLACK,
        "returned near the deadline"
    );
    assert_eq!(
        err,
        BootstrapError::UnknownEngine {
            address: server.address(),
            engine: e.clone()
        }
    );
    client(&server)
        .register(record("half", (0, 2), (0, 1), 1), soon())
        .await
        .expect("one of two");
    let deadline = Instant::now() + Duration::from_millis(300);
    let err = c
        .query(&EngineId::new("half"), deadline)
        .await
        .expect_err("incomplete");
    assert!(Instant::now() < deadline + SLACK);
    match &err {
        BootstrapError::NotReady {
            address,
            engine,
            registered,
            expected,
        } => {
            assert_eq!(address, &server.address());
            assert_eq!(engine.as_str(), "half");
            assert_eq!((registered.len(), *expected), (1, 2));
        }
        other => panic!("expected NotReady, got {other:?}"),
    }
    assert!(err.to_string().contains("1 of 2"), "{err}");
    // The server is unharmed: a status over the wire still works.
    assert_eq!(c.status(soon()).await.expect("status").engines.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_waits_for_the_engine_to_complete_within_its_deadline() {
    let server = server().await;
    let c = client(&server);
    client(&server)
        .register(record("p", (0, 2), (0, 1), 1), soon())
        .await
        .expect("first");
    let late = client(&server);
    let address = server.address();
    let joiner = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        late.register(record("p", (1, 2), (0, 1), 1), soon()).await
    });
    let workers = c
        .query(&EngineId::new("p"), Instant::now() + Duration::from_secs(3))
        .await
        .unwrap_or_else(|e| panic!("completes while waiting ({address}): {e}"));
    assert_eq!(workers.len(), 2);
    joiner.await.expect("join").expect("second registers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_expire_after_heartbeats_stop_but_not_while_they_flow() {
    let server =
        serve(ServerConfig::new("tcp://127.0.0.1:0").with_expire_after(Duration::from_millis(400)))
            .await
            .expect("server");
    let e = EngineId::new("p");
    let c = client(&server);
    c.register(record("p", (0, 1), (0, 1), 1), soon())
        .await
        .expect("register");
    // Heartbeats every 100 ms keep it through several expiry periods.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(matches!(
        server.query(&e).await.expect("query"),
        QueryAnswer::Ready { .. }
    ));
    drop(c); // heartbeats stop
    let gone_by = Instant::now() + Duration::from_millis(600) + Duration::from_secs(1);
    loop {
        if server.query(&e).await.expect("query") == QueryAnswer::UnknownEngine {
            break;
        }
        assert!(Instant::now() < gone_by, "record did not expire");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_alone_keeps_the_record() {
    let server = server().await;
    let r = record("p", (0, 1), (0, 1), 1);
    let mut dealer = Dealer::connect(&server.address(), b"raw", T)
        .await
        .expect("connect");
    dealer
        .send(vec![
            wire::encode(&Message::Register(r.clone()), None).expect("encode")
        ])
        .expect("send");
    let reply = tokio::time::timeout(T, dealer.recv())
        .await
        .expect("answer in time")
        .expect("answer");
    assert!(matches!(
        wire::decode(&reply[0], None),
        Ok(Message::RegisterOk(_))
    ));
    drop(dealer);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        server.query(&EngineId::new("p")).await.expect("query"),
        QueryAnswer::Ready { workers: vec![r] }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_removes_only_the_matching_incarnation_and_stops_heartbeats() {
    let server = server().await;
    let c = client(&server);
    let r = record("p", (0, 1), (0, 1), 4);
    c.register(r.clone(), soon()).await.expect("register");
    assert_eq!(c.unregister(&r.rank, 3, soon()).await, Ok(false));
    assert_eq!(c.unregister(&r.rank, 4, soon()).await, Ok(true));
    assert_eq!(
        server.query(&EngineId::new("p")).await.expect("query"),
        QueryAnswer::UnknownEngine
    );
    // Heartbeats do not bring it back.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(server.status().await.expect("status").engines, vec![]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_retries_until_a_late_server_starts_within_the_deadline() {
    let port = free_port();
    let address = format!("tcp://127.0.0.1:{port}");
    let c = BootstrapClient::new(&address, None, fast());
    let q = BootstrapClient::new(&address, None, fast());
    let deadline = Instant::now() + Duration::from_secs(4);
    let register = tokio::spawn({
        let c = c.clone();
        async move { c.register(record("p", (0, 1), (0, 1), 1), deadline).await }
    });
    let query = tokio::spawn(async move { q.query(&EngineId::new("p"), deadline).await });
    tokio::time::sleep(Duration::from_millis(600)).await;
    let server = serve(ServerConfig::new(address.clone()))
        .await
        .expect("late server binds the port");
    register
        .await
        .expect("join")
        .expect("registered once the server is up");
    let workers = query.await.expect("join").expect("query answered");
    assert_eq!(workers.len(), 1);
    assert!(Instant::now() < deadline);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_starts_is_unavailable_naming_the_address_within_the_deadline() {
    let address = format!("tcp://127.0.0.1:{}", free_port());
    let c = BootstrapClient::new(&address, None, fast());
    let started = Instant::now();
    let deadline = started + Duration::from_millis(500);
    let err = c
        .register(record("p", (0, 1), (0, 1), 1), deadline)
        .await
        .expect_err("nobody listens");
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(450) && elapsed < Duration::from_millis(500) + SLACK,
        "{elapsed:?}"
    );
    match &err {
        BootstrapError::Unavailable {
            address: a,
            last_error,
        } => {
            assert_eq!(a, &address);
            assert!(last_error.contains("connect"), "{last_error}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(matches!(
        err.failure_reason(),
        FailureReason::BootstrapUnavailable { address: a, .. } if a == address
    ));
    let started = Instant::now();
    let err = c
        .query(&EngineId::new("p"), started + Duration::from_millis(300))
        .await
        .expect_err("nobody listens");
    assert!(matches!(err, BootstrapError::Unavailable { .. }), "{err:?}");
    assert!(started.elapsed() < Duration::from_millis(300) + SLACK);
}

/// Starts a server on `address` again, retrying the bind while the stopped server's
/// listener is being released (see `BootstrapServer::stop`).
async fn rebind(address: &str) -> BootstrapServer {
    let by = Instant::now() + Duration::from_secs(2);
    loop {
        match serve(ServerConfig::new(address)).await {
            Ok(server) => return server,
            Err(e) if Instant::now() < by => {
                eprintln!("rebind {address}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("restarted server: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_registers_again_after_the_server_restarts() {
    let port = free_port();
    let address = format!("tcp://127.0.0.1:{port}");
    let first = serve(ServerConfig::new(address.clone()))
        .await
        .expect("server");
    let c = BootstrapClient::new(&address, None, fast());
    let r = record("p", (0, 1), (0, 1), 1);
    c.register(r.clone(), soon()).await.expect("register");
    first.stop().await;
    let second = rebind(&address).await;
    let e = EngineId::new("p");
    let by = Instant::now() + Duration::from_secs(3);
    loop {
        if second.query(&e).await.expect("query")
            == (QueryAnswer::Ready {
                workers: vec![r.clone()],
            })
        {
            break;
        }
        assert!(Instant::now() < by, "the client did not register again");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_answers_are_served_until_invalidated() {
    let server = server().await;
    let c = client(&server);
    let e = EngineId::new("p");
    c.register(record("p", (0, 1), (0, 1), 1), soon())
        .await
        .expect("register");
    let workers = c.query(&e, soon()).await.expect("ready");
    server.stop().await;
    assert_eq!(
        c.query(&e, Instant::now() + Duration::from_millis(100))
            .await
            .expect("from the cache"),
        workers
    );
    c.invalidate(&e);
    assert_eq!(c.cached(&e), None);
    let err = c
        .query(&e, Instant::now() + Duration::from_millis(200))
        .await
        .expect_err("server gone");
    assert!(matches!(err, BootstrapError::Unavailable { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_incarnation_is_not_handed_out_again_until_the_rank_re_registers() {
    // A worker killed a moment ago is still registered until its record expires: a lookup
    // in that window must not hand it out again (a request would wait on it, or be fenced
    // by it), but fail at once, naming it; its next incarnation is served again.
    let server = server().await;
    let c = client(&server);
    let e = EngineId::new("p");
    let first = record("p", (0, 1), (0, 1), 1);
    c.register(first.clone(), soon()).await.expect("register");
    c.query(&e, soon()).await.expect("ready");
    c.mark_lost(&first.rank, first.incarnation);
    assert_eq!(
        c.cached(&e),
        None,
        "the cached answer goes with the lost peer"
    );
    let t0 = Instant::now();
    let err = c
        .query(&e, Instant::now() + Duration::from_secs(5))
        .await
        .expect_err("only a lost incarnation is registered");
    assert!(
        matches!(err, BootstrapError::Lost { incarnation: 1, .. }),
        "{err:?}"
    );
    assert!(
        matches!(err.failure_reason(), FailureReason::PeerLost { .. }),
        "{err:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "failed only at the deadline"
    );
    // A dial to a peer already known still finds it: a worker lost while it was stopped
    // may have resumed, and only its handshake can say so. Such an answer is not cached,
    // so a new request's lookup still refuses the lost incarnation.
    assert_eq!(
        c.query_including_lost(&e, soon())
            .await
            .expect("for a dial"),
        vec![first.clone()]
    );
    assert_eq!(
        c.cached(&e),
        None,
        "an answer with a lost worker was cached"
    );
    let err = c.query(&e, soon()).await.expect_err("still lost");
    assert!(
        matches!(err, BootstrapError::Lost { incarnation: 1, .. }),
        "{err:?}"
    );
    let second = record("p", (0, 1), (0, 1), 2);
    c.register(second.clone(), soon())
        .await
        .expect("the restarted rank");
    assert_eq!(
        c.query(&e, soon()).await.expect("ready again"),
        vec![second]
    );
}

#[tokio::test]
async fn a_lost_worker_that_answers_again_is_handed_out_again() {
    // A worker lost while it was paused (SIGSTOP, a long stall) keeps its incarnation when
    // it resumes: once its process answers a handshake (the control loop says so with
    // `mark_found`), new requests may be paired with it again, not only after a restart.
    let server = server().await;
    let c = client(&server);
    let e = EngineId::new("p");
    let first = record("p", (0, 1), (0, 1), 1);
    c.register(first.clone(), soon()).await.expect("register");
    c.mark_lost(&first.rank, first.incarnation);
    let err = c.query(&e, soon()).await.expect_err("lost");
    assert!(
        matches!(err, BootstrapError::Lost { incarnation: 1, .. }),
        "{err:?}"
    );
    let other = record("p", (0, 1), (0, 1), 7);
    assert!(
        !c.mark_found(&other.rank, other.incarnation),
        "another incarnation was never lost"
    );
    assert!(c.query(&e, soon()).await.is_err(), "still lost");
    assert!(c.mark_found(&first.rank, first.incarnation));
    assert_eq!(
        c.query(&e, soon()).await.expect("found again"),
        vec![first.clone()]
    );
    assert!(!c.mark_found(&first.rank, first.incarnation), "found twice");
}

#[tokio::test]
async fn a_lost_mark_lasts_as_long_as_a_dead_record_can() {
    // Past `lost_kept` (longer than the server keeps a dead worker's record), a record still
    // held at the lost incarnation is one its process kept alive since the loss: a pause
    // that nothing dialed back from. It is handed out again; until then it is refused.
    let server = server().await;
    let kept = Duration::from_millis(400);
    let c = BootstrapClient::new(
        &server.address(),
        None,
        ClientConfig {
            lost_kept: kept,
            ..fast()
        },
    );
    let e = EngineId::new("p");
    let first = record("p", (0, 1), (0, 1), 1);
    c.register(first.clone(), soon()).await.expect("register");
    let marked = Instant::now();
    c.mark_lost(&first.rank, first.incarnation);
    let err = c.query(&e, soon()).await.expect_err("lost");
    assert!(
        matches!(err, BootstrapError::Lost { incarnation: 1, .. }),
        "{err:?}"
    );
    // Asked again and again until it is handed out (or the deadline).
    let deadline = soon();
    let found = loop {
        match c.query(&e, deadline).await {
            Ok(workers) => break workers,
            Err(BootstrapError::Lost { .. }) if Instant::now() < deadline => {
                tokio::task::yield_now().await;
            }
            Err(other) => panic!("still refused at the deadline: {other:?}"),
        }
    };
    assert!(
        marked.elapsed() >= kept,
        "handed out {:?} after the loss, before the mark's {kept:?}",
        marked.elapsed()
    );
    assert_eq!(found, vec![first]);
}

/// A log sink shared with a tracing subscriber.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn key() -> Key {
    Key::new(b"a shared secret of some length").expect("key")
}

// Current-thread runtime: the server's tasks run on this thread, under this subscriber.
#[tokio::test(flavor = "current_thread")]
async fn a_keyed_server_refuses_an_unkeyed_client_logs_it_and_serves_a_keyed_one() {
    let logs = Logs::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let server = serve(ServerConfig::new("tcp://127.0.0.1:0").with_key(key()))
        .await
        .expect("server");
    let unkeyed = client(&server);
    let err = unkeyed
        .register(record("p", (0, 1), (0, 1), 1), soon())
        .await
        .expect_err("no key");
    match &err {
        BootstrapError::Refused { address, detail } => {
            assert_eq!(address, &server.address());
            assert!(detail.contains("not authenticated"), "{detail}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    let wrong = BootstrapClient::new(
        &server.address(),
        Some(Key::new(b"another secret, just as long").expect("key")),
        fast(),
    );
    let err = wrong.status(soon()).await.expect_err("wrong key");
    match &err {
        BootstrapError::Refused { detail, .. } => {
            assert!(detail.contains("authentication failed"), "{detail}")
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    // The refusal of unauthenticated input is never signed (no signing oracle).
    let mut dealer = Dealer::connect(&server.address(), b"probe", T)
        .await
        .expect("connect");
    let unsigned = wire::encode(&Message::StatusRequest(wire::StatusRequest), None);
    dealer.send(vec![unsigned.expect("encode")]).expect("send");
    let reply = tokio::time::timeout(T, dealer.recv())
        .await
        .expect("in time")
        .expect("answer");
    assert_eq!(
        wire::decode(&reply[0], Some(&key())),
        Err(wire::WireError::AuthMissing)
    );
    assert!(matches!(
        wire::decode(&reply[0], None),
        Ok(Message::ProtocolError(_))
    ));
    let keyed = BootstrapClient::new(&server.address(), Some(key()), fast());
    keyed
        .register(record("p", (0, 1), (0, 1), 1), soon())
        .await
        .expect("keyed client served");
    assert_eq!(
        keyed
            .query(&EngineId::new("p"), soon())
            .await
            .expect("query")
            .len(),
        1
    );
    let text = logs.text();
    assert!(
        text.contains("refused")
            && text.contains("127.0.0.1:")
            && text.contains("not authenticated"),
        "refusal logged with the peer: {text}"
    );
    // A keyed client against an unkeyed server: its handshake gets no handshake answer,
    // refused by name (not retried until the deadline).
    let plain = server_plain().await;
    let err = BootstrapClient::new(&plain.address(), Some(key()), fast())
        .status(soon())
        .await
        .expect_err("unkeyed server");
    assert!(
        matches!(&err, BootstrapError::Refused { detail, .. } if detail.contains("authentication")),
        "{err:?}"
    );
    assert!(err.to_string().contains(&plain.address()), "{err}");
}

async fn server_plain() -> BootstrapServer {
    server().await
}

/// Sends one message on a fresh dealer and returns what came back before the server closed
/// the connection.
async fn send_raw(server: &BootstrapServer, frames: Vec<Vec<u8>>) -> Vec<Message> {
    let mut dealer = Dealer::connect(&server.address(), b"hostile", T)
        .await
        .expect("connect");
    dealer.send(frames).expect("send");
    let mut got = Vec::new();
    loop {
        match tokio::time::timeout(T, dealer.recv()).await {
            Ok(Some(reply)) => {
                got.push(wire::decode(&reply[0], None).expect("server frames decode"))
            }
            Ok(None) => return got, // closed by the server
            Err(_) => panic!("the server neither answered nor closed: {got:?}"),
        }
    }
}

fn protocol_error(replies: &[Message]) -> String {
    match replies {
        [Message::ProtocolError(ProtocolError { detail })] => detail.clone(),
        other => panic!("expected one ProtocolError, got {other:?}"),
    }
}

async fn still_serves(server: &BootstrapServer) {
    let c = client(server);
    c.status(soon()).await.expect("a valid client is served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_through_a_dealer_are_refused_by_name_and_the_server_keeps_serving() {
    let server = server().await;
    let valid = wire::encode(
        &Message::Query(Query {
            engine_id: EngineId::new("p"),
        }),
        None,
    )
    .expect("encode");
    let mut wrong_magic = valid.clone();
    wrong_magic[..4].copy_from_slice(b"NOPE");
    let mut wrong_version = valid.clone();
    wrong_version[4..6].copy_from_slice(&99u16.to_le_bytes());
    let mut oversized = valid[..16].to_vec();
    oversized[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut unknown_type = valid.clone();
    unknown_type[6..8].copy_from_slice(&0x7777u16.to_le_bytes());
    let truncated = valid[..valid.len() - 1].to_vec();
    let not_served = wire::encode(
        &Message::Done(handoff_transport::wire::Done {
            request_id: "r".into(),
            aux: vec![],
        }),
        None,
    )
    .expect("encode");
    let mut bad_hello = handoff_transport::wire::Hello::new(Role::Decode, RankInfo::single("d"), 1);
    bad_hello.protocol_version = 42;
    let bad_hello = wire::encode(&Message::Hello(bad_hello), None).expect("encode");
    let cases: Vec<(&str, Vec<Vec<u8>>, &str)> = vec![
        ("garbage", vec![b"hello there".to_vec()], "truncated"),
        ("empty", vec![vec![]], "truncated"),
        ("wrong magic", vec![wrong_magic], "magic"),
        ("wrong version", vec![wrong_version], "version 99"),
        ("oversized", vec![oversized], "exceeds the maximum"),
        ("unknown type", vec![unknown_type], "unknown message type"),
        ("truncated", vec![truncated], "truncated"),
        (
            "two frames",
            vec![valid.clone(), valid.clone()],
            "one frame",
        ),
        ("not served", vec![not_served], "unexpected Done"),
        ("hello, other version", vec![bad_hello], "version 42"),
    ];
    for (name, frames, expect) in cases {
        let replies = send_raw(&server, frames).await;
        let detail = protocol_error(&replies);
        assert!(detail.contains(expect), "{name}: {detail}");
        still_serves(&server).await;
    }
    // A good Hello is answered, and the connection goes on serving.
    let mut dealer = Dealer::connect(&server.address(), b"polite", T)
        .await
        .expect("connect");
    let hello = handoff_transport::wire::Hello::new(Role::Decode, RankInfo::single("d"), 1);
    for msg in [
        Message::Hello(hello),
        Message::Query(Query {
            engine_id: "p".into(),
        }),
    ] {
        dealer
            .send(vec![wire::encode(&msg, None).expect("encode")])
            .expect("send");
        let reply = tokio::time::timeout(T, dealer.recv())
            .await
            .expect("in time")
            .expect("open");
        let reply = wire::decode(&reply[0], None).expect("decode");
        assert!(
            matches!(reply, Message::HelloAck(_) | Message::QueryReply(_)),
            "{reply:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_bytes_on_a_plain_tcp_stream_cost_one_connection_and_nothing_else() {
    let server = server().await;
    let addr = server.local_addr();
    let payloads: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        vec![0xff; 4096],
        {
            // A ZMTP greeting, then a long frame announcing 1 TiB.
            let mut g = vec![0u8; 64];
            g[0] = 0xff;
            g[9] = 0x7f;
            g[10] = 3;
            g[12..16].copy_from_slice(b"NULL");
            g.extend_from_slice(&[0x02]);
            g.extend_from_slice(&(1u64 << 40).to_be_bytes());
            g
        },
        vec![0xff, 0, 0, 0], // half a greeting, then close
    ];
    for bytes in payloads {
        let joined = tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            let _ = s.write_all(&bytes);
            let _ = s.shutdown(std::net::Shutdown::Write);
            s.set_read_timeout(Some(Duration::from_secs(6)))
                .expect("timeout");
            let mut sink = [0u8; 256];
            while matches!(std::io::Read::read(&mut s, &mut sink), Ok(n) if n > 0) {}
        });
        tokio::time::timeout(Duration::from_secs(8), joined)
            .await
            .expect("closed in time")
            .expect("join");
        still_serves(&server).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_when_its_record_expires() {
    let server =
        serve(ServerConfig::new("tcp://127.0.0.1:0").with_expire_after(Duration::from_millis(200)))
            .await
            .expect("server");
    let mut dealer = Dealer::connect(&server.address(), b"silent", T)
        .await
        .expect("connect");
    let r = record("p", (0, 1), (0, 1), 1);
    dealer
        .send(vec![
            wire::encode(&Message::Register(r), None).expect("encode")
        ])
        .expect("send");
    let ok = tokio::time::timeout(T, dealer.recv())
        .await
        .expect("in time");
    assert!(ok.is_some());
    // No heartbeats: the record expires and the server closes the connection, so a live
    // but stuck client would notice and register again.
    let closed = tokio::time::timeout(Duration::from_secs(2), dealer.recv())
        .await
        .expect("closed within the expiry and a sweep");
    assert!(closed.is_none(), "no message expected: {closed:?}");
    assert_eq!(
        server.query(&EngineId::new("p")).await.expect("query"),
        QueryAnswer::UnknownEngine
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_serves_many_concurrent_callers() {
    let server = server().await;
    let c = client(&server);
    for tp in 0..4 {
        client(&server)
            .register(record("p", (0, 1), (tp, 4), 1), soon())
            .await
            .expect("register");
    }
    let mut tasks = Vec::new();
    for i in 0..32 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                c.invalidate(&EngineId::new("p"));
                c.query(&EngineId::new("p"), soon()).await.map(|w| w.len())
            } else {
                c.status(soon()).await.map(|s| s.engines[0].workers.len())
            }
        }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("join"), Ok(4));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_renders_as_an_aligned_table_and_stable_json() {
    let server = server().await;
    let c = client(&server);
    c.register(record("p", (0, 1), (0, 2), 12), soon())
        .await
        .expect("register");
    client(&server)
        .register(record("zz-decode", (3, 1), (0, 1), 5), soon())
        .await
        .expect("register");
    let status = c.status(soon()).await.expect("status");
    let table = render_table(&status);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(lines[0].starts_with("ENGINE"), "{table}");
    assert!(lines[1].contains("1 of 2 registered"), "{table}");
    assert!(
        lines[2].contains("complete") && lines[2].contains("3/0/0"),
        "{table}"
    );
    let col = |line: &str, word: &str| line.find(word);
    assert_eq!(col(lines[0], "INCARNATION"), col(lines[1], "12"), "{table}");
    let json = status_json(&server.address(), &status);
    assert_eq!(json["server"], server.address());
    assert_eq!(json["engines"][0]["engine_id"], "p");
    assert_eq!(json["engines"][0]["complete"], false);
    assert_eq!(json["engines"][0]["registered"], 1);
    assert_eq!(json["engines"][0]["expected"], 2);
    assert_eq!(json["engines"][1]["workers"][0]["dp_rank"], 3);
    assert_eq!(json["engines"][1]["workers"][0]["incarnation"], 5);
    assert_eq!(
        json["engines"][1]["workers"][0]["control_address"],
        "tcp://10.0.3.0:5000"
    );
    assert_eq!(
        render_table(&handoff_bootstrap::StatusReply { engines: vec![] }),
        "no workers registered\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_on_a_port_in_use_fails_with_a_named_error() {
    let busy = server().await;
    let err = serve(ServerConfig::new(busy.address()))
        .await
        .err()
        .expect("port in use");
    assert!(
        matches!(&err, BootstrapError::Bind { address, .. } if *address == busy.address()),
        "{err:?}"
    );
}

#[test]
fn secret_files_are_read_with_one_trailing_newline_ignored_and_bounded() {
    use handoff_bootstrap::load_key;
    let dir = std::env::temp_dir().join(format!("handoff-boot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).expect("write");
        p
    };
    let with_newline = load_key(&write("nl", b"0123456789abcdef\n")).expect("16 bytes + newline");
    let without = load_key(&write("plain", b"0123456789abcdef")).expect("16 bytes");
    // Same secret: a frame signed by one verifies under the other.
    let frame = wire::encode(
        &Message::StatusRequest(wire::StatusRequest),
        Some(&with_newline),
    )
    .expect("encode");
    assert!(wire::decode(&frame, Some(&without)).is_ok());
    let short = load_key(&write("short", b"0123456789abcde\n")).expect_err("15 bytes");
    assert!(short.to_string().contains("short"), "{short}");
    let big = load_key(&write("big", &[b'x'; 5000])).expect_err("too big");
    assert!(big.to_string().contains("at most 4096"), "{big}");
    let _ = std::fs::remove_dir_all(&dir);
}
