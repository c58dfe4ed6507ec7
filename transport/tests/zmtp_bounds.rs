//! The ROUTER's bounds under hostile load, over real sockets on loopback: pending
//! (not yet admitted) connections are bounded per source and in all while admitted peers
//! keep working; a connection that does not read its replies is dropped, not buffered; a
//! flood on one connection does not delay another's messages behind it.

use std::time::Duration;

use handoff_transport::zmtp::{
    ConnId, Dealer, Router, RouterEvent, CONNECTION_INFLIGHT_MAX, PENDING_PER_SOURCE_MAX,
    SEND_QUEUES_BYTES_MAX,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(5);

async fn message(router: &mut Router) -> (ConnId, Vec<Vec<u8>>) {
    loop {
        match tokio::time::timeout(T, router.recv()).await {
            Ok(Some(RouterEvent::Message { conn, frames, .. })) => return (conn, frames),
            Ok(Some(_)) => continue,
            other => panic!("no message in time: {other:?}"),
        }
    }
}

/// A raw client that completes ZMTP's greeting and READY, then holds the connection.
async fn idle_client(addr: std::net::SocketAddr) -> Option<TcpStream> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    let mut greeting = vec![0u8; 64];
    greeting[0] = 0xff;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[12..16].copy_from_slice(b"NULL");
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&6u32.to_be_bytes());
    body.extend_from_slice(b"DEALER");
    let mut ready = vec![0x04, body.len() as u8];
    ready.extend_from_slice(&body);
    s.write_all(&greeting).await.ok()?;
    s.write_all(&ready).await.ok()?;
    Some(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_flood_cannot_lock_out_an_admitted_peer() {
    let mut router = Router::bind("tcp://127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = router.local_addr();
    let mut peer = Dealer::connect(&format!("tcp://{addr}"), b"", T)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    peer.send(vec![b"hello".to_vec()])
        .unwrap_or_else(|e| panic!("{e}"));
    let (conn, _) = message(&mut router).await;
    router.admit(conn);
    // Three times the per-source bound of idle strangers from the same address.
    let mut flood = Vec::new();
    for _ in 0..3 * PENDING_PER_SOURCE_MAX {
        if let Some(s) = idle_client(addr).await {
            flood.push(s);
        }
    }
    // The admitted peer is served at once, the refusals are counted.
    let started = std::time::Instant::now();
    peer.send(vec![b"heartbeat".to_vec()])
        .unwrap_or_else(|e| panic!("{e}"));
    let (from, frames) = message(&mut router).await;
    assert_eq!((from, frames), (conn, vec![b"heartbeat".to_vec()]));
    router
        .send(conn, vec![b"ack".to_vec()])
        .unwrap_or_else(|e| panic!("{e}"));
    let ack = tokio::time::timeout(T, peer.recv()).await.ok().flatten();
    assert_eq!(ack, Some(vec![b"ack".to_vec()]));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // A newcomer from the same address (a `status`) still gets its exchange through: the
    // oldest idle stranger is evicted for it.
    let newcomer = Dealer::connect(&format!("tcp://{addr}"), b"", T)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    newcomer
        .send(vec![b"status".to_vec()])
        .unwrap_or_else(|e| panic!("{e}"));
    let (_, frames) = message(&mut router).await;
    assert_eq!(frames, vec![b"status".to_vec()]);
    let stats = router.stats();
    assert!(
        stats.refused_source >= PENDING_PER_SOURCE_MAX as u64,
        "{stats:?}"
    );
    assert!(
        router.connections() <= PENDING_PER_SOURCE_MAX + 1,
        "{}",
        router.connections()
    );
}

/// A router on loopback, and its address for dealers.
async fn router() -> (Router, String) {
    let router = Router::bind("tcp://127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = format!("tcp://{}", router.local_addr());
    (router, addr)
}

/// A dealer that asked one question, and its connection as the router sees it.
async fn asked(router: &mut Router, addr: &str) -> (Dealer, ConnId) {
    let dealer = Dealer::connect(addr, b"", T)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    dealer
        .send(vec![b"status?".to_vec()])
        .unwrap_or_else(|e| panic!("{e}"));
    let (conn, _) = message(router).await;
    (dealer, conn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_dropped_not_buffered() {
    let (mut router, addr) = router().await;
    // A dealer whose receiving half is never read: its inbox fills, then TCP backs up.
    let (dealer, conn) = asked(&mut router, &addr).await;
    let reply = vec![0u8; 4 << 20];
    let mut dropped = false;
    for _ in 0..4096 {
        if router.send(conn, vec![reply.clone()]).is_err() {
            dropped = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(dropped, "never dropped");
    assert_eq!(router.stats().dropped_slow, 1);
    drop(dealer);
}

/// Several clients that never read, each under the per-connection bound: together they
/// cannot hold more than the listener's bound, the one holding the most is dropped and its
/// queue freed (its connection ends), and a peer that reads still gets its replies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_together_cannot_pin_more_than_the_listener_bound() {
    let (mut router, addr) = router().await;
    let mut slow = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..6 {
        let (dealer, conn) = asked(&mut router, &addr).await;
        conns.push(conn);
        slow.push(dealer);
    }
    let reply = vec![0u8; 4 << 20];
    for _ in 0..20 {
        for c in &conns {
            let _ = router.send(*c, vec![reply.clone()]);
            assert!(
                router.queued_bytes() <= SEND_QUEUES_BYTES_MAX + reply.len(),
                "{} bytes queued",
                router.queued_bytes()
            );
        }
        tokio::task::yield_now().await;
    }
    assert!(router.stats().dropped_slow >= 1, "{:?}", router.stats());
    // The dropped connections ended: what they held left the total.
    let until = tokio::time::Instant::now() + T;
    while router.queued_bytes() > SEND_QUEUES_BYTES_MAX {
        assert!(
            tokio::time::Instant::now() < until,
            "{}",
            router.queued_bytes()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A peer that reads is served.
    let (mut honest, conn) = asked(&mut router, &addr).await;
    router
        .send(conn, vec![b"ok".to_vec()])
        .unwrap_or_else(|e| panic!("{e}"));
    let got = tokio::time::timeout(T, honest.recv()).await;
    assert!(
        matches!(got, Ok(Some(ref f)) if *f == vec![b"ok".to_vec()]),
        "{got:?}"
    );
    drop(slow);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_on_one_connection_does_not_queue_another_peer_behind_it() {
    let mut router = Router::bind("tcp://127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = format!("tcp://{}", router.local_addr());
    let flooder = Dealer::connect(&addr, b"", T)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let honest = Dealer::connect(&addr, b"", T)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Without the per-connection bound the router's shared queue would fill with these
    // (up to RECV_QUEUE_MESSAGES_MAX) ahead of the heartbeat. With it, they wait in the
    // flooder's socket buffers and queue (about 56 KB), so every one of them is sent.
    let flood = 8000;
    let deadline = tokio::time::Instant::now() + T;
    let mut sent = 0;
    while sent < flood {
        if flooder.send(vec![b"flood".to_vec()]).is_ok() {
            sent += 1;
        } else {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the flood did not fit the socket buffers ({sent} sent)"
            );
            tokio::task::yield_now().await;
        }
    }
    // The flood is arriving (the router's queue is not drained otherwise).
    let (_, first) = message(&mut router).await;
    assert_eq!(first, vec![b"flood".to_vec()]);
    honest
        .send(vec![b"heartbeat".to_vec()])
        .unwrap_or_else(|e| panic!("{e}"));
    let mut position = 0;
    loop {
        let (_, frames) = message(&mut router).await;
        position += 1;
        if frames == vec![b"heartbeat".to_vec()] {
            break;
        }
        // With the bound: at most CONNECTION_INFLIGHT_MAX ahead of it, plus what the
        // consumer takes while the honest connection's task waits to be scheduled (once
        // 470 on a loaded 2-core machine); without it, the router's whole queue
        // (RECV_QUEUE_MESSAGES_MAX, 4096).
        assert!(
            position <= flood / 4,
            "heartbeat still queued behind {position} flood messages (bound {CONNECTION_INFLIGHT_MAX} in the queue)"
        );
    }
}
