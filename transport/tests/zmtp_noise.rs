//! ZMTP with a shared secret: every connection runs a Noise handshake and seals every
//! message. Real sockets on loopback; an eavesdropper records what an honest dealer sent and
//! replays it, byte for byte, on a new connection and on the same one.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_transport::auth::Key;
use handoff_transport::zmtp::{ConnId, Dealer, Router, RouterEvent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const T: Duration = Duration::from_secs(5);

fn key(secret: &[u8]) -> Key {
    Key::new(secret).unwrap_or_else(|e| panic!("{e}"))
}

/// The next message, or `None` if the router hands up nothing but connection events
/// within `wait`.
async fn message_within(router: &mut Router, wait: Duration) -> Option<(ConnId, Vec<Vec<u8>>)> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, router.recv()).await {
            Ok(Some(RouterEvent::Message { conn, frames, .. })) => return Some((conn, frames)),
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return None,
        }
    }
}

/// Waits for `conn` (or any connection, if `None`) to be reported gone.
async fn disconnected(router: &mut Router, wait: Duration) -> Option<String> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, router.recv()).await {
            Ok(Some(RouterEvent::Disconnected { reason, .. })) => return Some(reason),
            Ok(Some(RouterEvent::Message { frames, .. })) => {
                panic!("a message got through: {frames:?}")
            }
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_messages_round_trip_whatever_their_size() {
    let k = key(b"zmtp-noise-secret-0123456789");
    let mut router = Router::bind_with("tcp://127.0.0.1:0", Some(k.clone()), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = format!("tcp://{}", router.local_addr());
    let mut dealer = Dealer::connect_with(&addr, b"", T, Some(k))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let big: Vec<u8> = (0..1_000_000u32).map(|i| i as u8).collect();
    for frames in [
        vec![b"hello".to_vec()],
        vec![Vec::new(), vec![1; 300]],
        vec![big.clone()],
    ] {
        dealer
            .send(frames.clone())
            .unwrap_or_else(|e| panic!("{e}"));
        let (conn, got) = message_within(&mut router, T)
            .await
            .unwrap_or_else(|| panic!("no message"));
        assert_eq!(got, frames);
        router
            .send(conn, frames.clone())
            .unwrap_or_else(|e| panic!("{e}"));
        let back = tokio::time::timeout(T, dealer.recv()).await.ok().flatten();
        assert_eq!(back, Some(frames));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_secret_gets_nothing_through() {
    let mut router = Router::bind_with(
        "tcp://127.0.0.1:0",
        Some(key(b"zmtp-noise-secret-0123456789")),
        Some(b"refused: no secret".to_vec()),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let addr = format!("tcp://{}", router.local_addr());
    // Another secret: the handshake fails on both ends.
    let other = Dealer::connect_with(&addr, b"", T, Some(key(b"another-secret-0123456789"))).await;
    assert!(other.is_err(), "a dealer with another secret connected");
    let reason = disconnected(&mut router, T).await;
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("authentication")),
        "{reason:?}"
    );
    // No secret: its first message is not a handshake message.
    // No secret: its first message is not a handshake message; it is told so, in the clear.
    let mut plain = Dealer::connect(&addr, b"", T)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = plain.send(vec![b"Register".to_vec()]);
    let reason = disconnected(&mut router, T).await;
    assert!(reason.is_some(), "the plain dealer was not dropped");
    let told = tokio::time::timeout(T, plain.recv()).await.ok().flatten();
    assert_eq!(told, Some(vec![b"refused: no secret".to_vec()]));
}

/// A TCP relay that records every byte the client sends.
async fn recording_relay(upstream: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = format!(
        "tcp://{}",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    let log = Arc::new(Mutex::new(Vec::new()));
    let record = log.clone();
    tokio::spawn(async move {
        let Ok((client, _)) = listener.accept().await else {
            return;
        };
        let Ok(server) = TcpStream::connect(upstream.trim_start_matches("tcp://")).await else {
            return;
        };
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        let up = async move {
            let mut buf = vec![0u8; 65536];
            while let Ok(n) = cr.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                record
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&buf[..n]);
                if sw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        };
        let down = async move {
            let _ = tokio::io::copy(&mut sr, &mut cw).await;
        };
        tokio::join!(up, down);
    });
    (addr, log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_bytes_replayed_on_a_new_connection_are_refused() {
    let k = key(b"zmtp-noise-secret-0123456789");
    let mut router = Router::bind_with("tcp://127.0.0.1:0", Some(k.clone()), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let upstream = format!("tcp://{}", router.local_addr());
    let (relay, log) = recording_relay(upstream.clone()).await;
    let dealer = Dealer::connect_with(&relay, b"", T, Some(k))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for m in [b"Register".to_vec(), b"Heartbeat".to_vec()] {
        dealer.send(vec![m]).unwrap_or_else(|e| panic!("{e}"));
        assert!(message_within(&mut router, T).await.is_some());
    }
    let captured = log.lock().unwrap_or_else(|e| e.into_inner()).clone();
    // The whole capture (greeting, READY, the handshake's first message, both sealed
    // messages) replayed on a new connection: the router answers the handshake with a fresh
    // ephemeral, so the sealed frames do not open.
    let mut replay = TcpStream::connect(upstream.trim_start_matches("tcp://"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    replay
        .write_all(&captured)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let reason = disconnected(&mut router, T).await;
    assert!(
        reason.as_deref().is_some_and(|r| r.contains("refused")),
        "{reason:?}"
    );
    // And the honest dealer still works.
    dealer
        .send(vec![b"after".to_vec()])
        .unwrap_or_else(|e| panic!("{e}"));
    let (_, frames) = message_within(&mut router, T)
        .await
        .unwrap_or_else(|| panic!("the honest dealer was cut off"));
    assert_eq!(frames, vec![b"after".to_vec()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_before_the_handshake_is_refused_before_it_is_read() {
    let k = key(b"zmtp-noise-secret-0123456789");
    let mut router = Router::bind_with("tcp://127.0.0.1:0", Some(k), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = router.local_addr();
    // A plain dealer completes ZMTP's handshake, then announces a 16 MiB frame.
    let mut raw = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut greeting = vec![0u8; 64];
    greeting[0] = 0xff;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[12..16].copy_from_slice(b"NULL");
    let mut ready = vec![0x04, 0];
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&6u32.to_be_bytes());
    body.extend_from_slice(b"DEALER");
    ready[1] = body.len() as u8;
    ready.extend_from_slice(&body);
    let mut huge = vec![0x02];
    huge.extend_from_slice(&(16u64 << 20).to_be_bytes());
    for part in [greeting, ready, huge] {
        raw.write_all(&part).await.unwrap_or_else(|e| panic!("{e}"));
    }
    let reason = disconnected(&mut router, T).await;
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("authentication") && r.contains("at most 128")),
        "{reason:?}"
    );
}
