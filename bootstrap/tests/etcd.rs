//! The etcd directory against real etcd members started by the tests: the registry's rules
//! over a transaction, racing registrations, the watch that drops cached answers, and
//! values in the store that are not ours.

use std::time::{Duration, Instant};

use handoff_bootstrap::etcd::{b64, CACHE_AGE_MAX, KNOWN_FALLBACK_AFTER, LEASE_TTL};
use handoff_bootstrap::{BootstrapError, EtcdDirectory, Key, WorkerRecord};
use handoff_testkit::etcd::{address, Etcd};
use handoff_transport::EngineId;

mod common;

const T: Duration = Duration::from_secs(5);

fn soon() -> Instant {
    Instant::now() + T
}

fn record(engine: &str, tp: (u32, u32), incarnation: u64) -> WorkerRecord {
    common::record(engine, (0, 1), tp, incarnation)
}

fn dir(etcd: &Etcd, cluster: &str, key: Option<Key>) -> EtcdDirectory {
    EtcdDirectory::new(&address(&[etcd], cluster), key).expect("an etcd address")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_follow_the_registry_rules() {
    let Some(etcd) = Etcd::single("registrations_follow_the_registry_rules") else {
        return;
    };
    let (a, b) = (dir(&etcd, "rules", None), dir(&etcd, "rules", None));
    let engine = EngineId::new("P");
    // Not known, then not ready until both tensor-parallel ranks are in.
    assert!(matches!(
        b.query(&engine, soon()).await,
        Err(BootstrapError::UnknownEngine { .. })
    ));
    a.register(record("P", (0, 2), 5), soon()).await.unwrap();
    match b.query(&engine, soon()).await {
        Err(BootstrapError::NotReady {
            registered,
            expected: 2,
            ..
        }) => assert_eq!(registered.len(), 1),
        other => panic!("{other:?}"),
    }
    // The same record again is fine.
    a.register(record("P", (0, 2), 5), soon()).await.unwrap();
    // An older incarnation, or the same one with other addresses, is a conflict that names
    // the record kept; so is a rank whose sizes disagree with the engine's.
    for bad in [
        record("P", (0, 2), 4),
        WorkerRecord {
            control_address: "tcp://10.9.9.9:1".into(),
            ..record("P", (0, 2), 5)
        },
        record("P", (1, 4), 9),
    ] {
        match b.register(bad.clone(), soon()).await {
            Err(BootstrapError::Conflict { existing, address }) => {
                assert_eq!(existing.rank.tp_rank, 0, "{bad:?}");
                assert!(address.contains(&etcd.client), "{address}");
            }
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    // A newer incarnation replaces; the second rank completes the engine.
    b.register(record("P", (0, 2), 6), soon()).await.unwrap();
    b.register(record("P", (1, 2), 1), soon()).await.unwrap();
    let mut got = a.query(&engine, soon()).await.unwrap();
    got.sort_by_key(|r| r.rank.tp_rank);
    assert_eq!(got, vec![record("P", (0, 2), 6), record("P", (1, 2), 1)]);
}

/// A rank this directory lost is not handed out again to pair a new request until it
/// registers anew, as with the server; a dial to it (a peer already known) still finds it,
/// since a worker lost while it was stopped may have resumed and only its handshake can say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_incarnation_is_refused_to_new_requests_but_found_for_a_dial() {
    let Some(etcd) = Etcd::single("a_lost_incarnation_is_refused_to_new_requests") else {
        return;
    };
    let d = dir(&etcd, "lost", None);
    let engine = EngineId::new("P");
    let first = record("P", (0, 1), 3);
    d.register(first.clone(), soon()).await.unwrap();
    assert_eq!(d.query(&engine, soon()).await.unwrap(), vec![first.clone()]);
    d.mark_lost(&first.rank, first.incarnation);
    match d.query(&engine, soon()).await {
        Err(BootstrapError::Lost { incarnation: 3, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(
        d.query_including_lost(&engine, soon()).await.unwrap(),
        vec![first.clone()]
    );
    // The dial's answer was not cached for new requests.
    assert!(matches!(
        d.query(&engine, soon()).await,
        Err(BootstrapError::Lost { .. })
    ));
    // The very process answered the dial's handshake: it was paused, not dead, and new
    // requests may be paired with it again.
    assert!(d.mark_found(&first.rank, first.incarnation));
    assert_eq!(d.query(&engine, soon()).await.unwrap(), vec![first.clone()]);
    d.mark_lost(&first.rank, first.incarnation);
    let second = record("P", (0, 1), 4);
    d.register(second.clone(), soon()).await.unwrap();
    assert_eq!(d.query(&engine, soon()).await.unwrap(), vec![second]);
}

/// etcd goes away after a request was paired: the dial to its peer (a lookup with lost
/// workers included) takes the last answer read, well before its deadline; pairing a new
/// request, or dialing an engine never read, fails by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_gone_a_dial_takes_the_last_answer_read_and_new_pairings_fail() {
    let Some(mut etcd) = Etcd::single("with_etcd_gone_a_dial_takes_the_last_answer_read") else {
        return;
    };
    let d = dir(&etcd, "gone", None);
    let engine = EngineId::new("P");
    let first = record("P", (0, 1), 3);
    d.register(first.clone(), soon()).await.unwrap();
    assert_eq!(d.query(&engine, soon()).await.unwrap(), vec![first.clone()]);
    etcd.kill9();
    // Once the cut watch has dropped what it cached, only the fallback can answer.
    let cut = soon();
    while d.is_cached(&engine) {
        assert!(
            Instant::now() < cut,
            "the watch never noticed etcd was gone"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The fallback comes after KNOWN_FALLBACK_AFTER, long before this deadline (without
    // it, the lookup fails Unavailable at the deadline).
    let by = Instant::now() + KNOWN_FALLBACK_AFTER * 4;
    assert_eq!(
        d.query_including_lost(&engine, by).await.unwrap(),
        vec![first.clone()]
    );
    let shortly = || Instant::now() + Duration::from_millis(300);
    for (what, got) in [
        ("a new pairing", d.query(&engine, shortly()).await),
        (
            "a dial to an engine never read",
            d.query_including_lost(&EngineId::new("Q"), shortly()).await,
        ),
    ] {
        match got {
            Err(BootstrapError::Unavailable { address, .. }) => {
                assert!(address.contains(&etcd.client), "{what}: {address}")
            }
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// Many directories race to register different records for one rank: exactly one wins
/// (the transaction holds only where nothing changed since the read), the others are told
/// the winner's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_registrations_of_one_rank_have_one_winner() {
    let Some(etcd) = Etcd::single("racing_registrations_of_one_rank_have_one_winner") else {
        return;
    };
    let racers: Vec<_> = (0..8u32)
        .map(|i| {
            let d = dir(&etcd, "race", None);
            let mut r = record("R", (0, 1), 7);
            r.control_address = format!("tcp://10.1.0.{i}:5000");
            tokio::spawn(async move { (d.register(r.clone(), soon()).await, r, d) })
        })
        .collect();
    let mut winners = Vec::new();
    let mut keepers = Vec::new();
    for racer in racers {
        let (result, r, d) = racer.await.unwrap();
        match result {
            Ok(()) => winners.push(r),
            Err(BootstrapError::Conflict { existing, .. }) => keepers.push(*existing),
            Err(other) => panic!("{other}"),
        }
        keepers.retain(|k| k.incarnation == 7);
        drop(d);
    }
    assert_eq!(winners.len(), 1, "{winners:?}");
    assert!(keepers.iter().all(|k| *k == winners[0]), "{keepers:?}");
}

/// A newer process that takes a rank writes its key under its own lease, while the old
/// process (stopped, then resumed, say) renews a lease that no longer holds it: the old
/// one's keep-alive reads the key back, finds the newer record and says so (`superseded`),
/// and renews no more. The newer record is what lookups find.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_process_of_a_rank_supersedes_the_old_one() {
    let Some(etcd) = Etcd::single("a_newer_process_of_a_rank_supersedes_the_old_one") else {
        return;
    };
    let old = dir(&etcd, "superseded", None);
    let first = record("S", (0, 1), 1);
    old.register(first.clone(), soon())
        .await
        .expect("first life");
    let superseded = old.superseded(&first.rank, first.incarnation);
    let other = old.superseded(&first.rank, 7);
    let mut second = record("S", (0, 1), 2);
    second.control_address = "tcp://10.1.1.1:5001".into();
    let newer = dir(&etcd, "superseded", None);
    newer
        .register(second.clone(), soon())
        .await
        .expect("second life replaces the first");
    let holder = tokio::time::timeout(LEASE_TTL, superseded)
        .await
        .expect("found at the next renewal");
    assert_eq!(holder, second);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), other)
            .await
            .is_err(),
        "only the superseded incarnation is told"
    );
    assert_eq!(
        newer.query(&EngineId::new("S"), soon()).await.unwrap(),
        vec![second]
    );
}

/// A cached answer is dropped when the watch sees the engine change: a restart elsewhere is
/// seen well before the cache's age bound, without this directory losing anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_drops_a_cached_answer_when_its_engine_changes() {
    let Some(etcd) = Etcd::single("the_watch_drops_a_cached_answer_when_its_engine_changes") else {
        return;
    };
    let (looker, first, restarted) = (
        dir(&etcd, "watch", None),
        dir(&etcd, "watch", None),
        dir(&etcd, "watch", None),
    );
    let engine = EngineId::new("W");
    first
        .register(record("W", (0, 1), 1), soon())
        .await
        .unwrap();
    // Asked until the watch is open and the answer cached.
    let deadline = soon();
    loop {
        let got = looker.query(&engine, deadline).await.unwrap();
        assert_eq!(got[0].incarnation, 1);
        if looker.is_cached(&engine) {
            break;
        }
        assert!(Instant::now() < deadline, "the answer was never cached");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let changed = Instant::now();
    restarted
        .register(record("W", (0, 1), 2), soon())
        .await
        .unwrap();
    loop {
        let got = looker.query(&engine, soon()).await.unwrap();
        if got[0].incarnation == 2 {
            break;
        }
        assert!(
            changed.elapsed() < T,
            "the restart was not seen within {T:?} (cache bound {CACHE_AGE_MAX:?})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(changed.elapsed() < CACHE_AGE_MAX);
}

/// Records not tagged with the cluster's key (another key's, or none), and values that are
/// not records at all, are skipped by a keyed directory: never used, never a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_that_are_not_this_clusters_records_are_ignored() {
    let Some(etcd) = Etcd::single("values_that_are_not_this_clusters_records_are_ignored") else {
        return;
    };
    let key = Key::new(b"a secret of at least thirty-two bytes, for tests").unwrap();
    let other = Key::new(b"another secret of at least thirty-two bytes here").unwrap();
    dir(&etcd, "keyed", Some(key.clone()))
        .register(record("K", (0, 1), 1), soon())
        .await
        .unwrap();
    let engine = EngineId::new("K");
    assert_eq!(
        dir(&etcd, "keyed", Some(key.clone()))
            .query(&engine, soon())
            .await
            .unwrap()
            .len(),
        1
    );
    // Another key does not check the tag: the record is not used.
    assert!(matches!(
        dir(&etcd, "keyed", Some(other))
            .query(&engine, soon())
            .await,
        Err(BootstrapError::UnknownEngine { .. })
    ));
    // A record planted without the key is not used by those who hold it.
    dir(&etcd, "keyed", None)
        .register(record("U", (0, 1), 1), soon())
        .await
        .unwrap();
    assert!(matches!(
        dir(&etcd, "keyed", Some(key.clone()))
            .query(&EngineId::new("U"), soon())
            .await,
        Err(BootstrapError::UnknownEngine { .. })
    ));
    // Garbage written straight into the engine's range, beside the real record.
    let hex: String = b"K".iter().map(|b| format!("{b:02x}")).collect();
    let put = |k: &str, v: &[u8]| {
        let body = format!(
            "{{\"key\":\"{}\",\"value\":\"{}\"}}",
            b64(k.as_bytes()),
            b64(v)
        );
        assert!(etcd.post("/v3/kv/put", &body).is_some(), "put {k}");
    };
    put(&format!("handoff/keyed/w/{hex}/0.1.0"), b"not a frame");
    put(&format!("handoff/keyed/w/{hex}/9.9.9"), &[0xff; 300]);
    let got = dir(&etcd, "keyed", Some(key))
        .query(&engine, soon())
        .await
        .unwrap();
    assert_eq!(got, vec![record("K", (0, 1), 1)]);
}
