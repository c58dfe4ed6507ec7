//! Large TCP calls in stripes: over several connections at once, a thread each. Every byte
//! lands where it belongs, keyed or not; a refusal on one stripe fails the call by name and
//! stops the others; a server that stops answering fails the call at its deadline; and the
//! client goes on serving calls after each.

mod data_common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use data_common::{checksum, fill, ids, Rng, TableGrants};
use handoff_transport::auth::Key;
use handoff_transport::data::{Access, AllowAll, DataError, Grants, RefusalCode};
use handoff_transport::same_host::lanes_for;
use handoff_transport::tcp::{DataClient, DataServer, ServerConfig, OP_BYTES_MAX};
use handoff_transport::{RankInfo, Region, RequestId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// 16 MiB of 16 KiB blocks: a call over all of them is four operations of 4 MiB.
const BLOCKS: u32 = 1024;
const BLOCK_BYTES: usize = 16 * 1024;
const STEP: Duration = Duration::from_secs(20);

fn deadline() -> Instant {
    Instant::now() + STEP
}

async fn server(grants: Arc<dyn Grants>, key: Option<Key>) -> (DataServer, Arc<Region>) {
    data_common::tcp_server(BLOCKS, BLOCK_BYTES, grants, key, ServerConfig::default()).await
}

async fn client(addr: &str, key: Option<Key>) -> DataClient {
    DataClient::connect(addr, RankInfo::single("prefill"), key, STEP)
        .await
        .unwrap()
}

/// The stripes a call over the whole region gets here: one per MiB up to the cores this
/// process may use (the same-host copies' rule), at most its four operations.
fn stripes_here() -> u64 {
    let ops = (BLOCKS as usize * BLOCK_BYTES).div_ceil(OP_BYTES_MAX);
    lanes_for((BLOCKS as usize * BLOCK_BYTES) as u64).min(ops) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_call_moves_every_byte_in_stripes_keyed_or_not() {
    for key in [None, Some(Key::new(b"stripes-secret-0123456789").unwrap())] {
        let (server, remote) = server(Arc::new(AllowAll), key.clone()).await;
        let c = client(&server.local_addr().to_string(), key.clone()).await;
        let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
        fill(&local, 21);
        let (src, dst) = (ids(0..BLOCKS), Rng::new(3).permutation(BLOCKS));
        c.write(&RequestId::new("w"), &local, &src, &dst, deadline())
            .await
            .unwrap();
        assert_eq!(checksum(&remote, &dst), checksum(&local, &src));
        // One connection per stripe, opened by the first call and pooled for the next.
        assert_eq!(server.stats().connections, stripes_here(), "key {key:?}");
        let back = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
        let order = Rng::new(4).permutation(BLOCKS);
        c.read(&RequestId::new("r"), &back, &dst, &order, deadline())
            .await
            .unwrap();
        assert_eq!(checksum(&back, &order), checksum(&local, &src));
        // A one-block call reuses a stripe's pooled connection on the runtime's own path.
        let one = Region::new(1, BLOCK_BYTES).unwrap();
        c.read(
            &RequestId::new("r"),
            &one,
            &dst[..1],
            &ids(0..1),
            deadline(),
        )
        .await
        .unwrap();
        assert_eq!(checksum(&one, &ids(0..1)), checksum(&local, &src[..1]));
        assert_eq!(server.stats().connections, stripes_here(), "key {key:?}");
        assert_eq!(server.stats().writes, 4);
        assert_eq!(server.stats().reads, 5);
        assert_eq!(server.stats().refused, 0);
        assert_eq!(server.stats().dropped_connections, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_on_one_stripe_fails_the_call_by_name_and_the_client_goes_on() {
    let grants = Arc::new(TableGrants::default());
    // The last operation's blocks are not granted: whichever stripe takes it is refused.
    grants.grant("r", Access::Write, 0..BLOCKS - 1);
    grants.grant("r", Access::Read, 0..BLOCKS);
    let (server, remote) = server(grants, None).await;
    let c = client(&server.local_addr().to_string(), None).await;
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 5);
    let all = ids(0..BLOCKS);
    let err = c
        .write(&RequestId::new("r"), &local, &all, &all, deadline())
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            DataError::Refused {
                code: RefusalCode::NotGranted,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(server.stats().refused, 1);
    // The ungranted block was not written.
    let zero = Region::new(1, BLOCK_BYTES).unwrap();
    assert_eq!(
        checksum(&remote, &ids(BLOCKS - 1..BLOCKS)),
        checksum(&zero, &ids(0..1))
    );
    // The same client serves the next calls, in stripes again.
    let granted = ids(0..BLOCKS - 1);
    c.write(&RequestId::new("r"), &local, &granted, &granted, deadline())
        .await
        .unwrap();
    let back = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    c.read(&RequestId::new("r"), &back, &granted, &granted, deadline())
        .await
        .unwrap();
    assert_eq!(checksum(&back, &granted), checksum(&local, &granted));
}

/// A relay to `upstream` that forwards nothing either way while `frozen` is set: a server
/// (or a path to it) that stops answering.
async fn freezing_relay(upstream: std::net::SocketAddr) -> (String, Arc<AtomicBool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let frozen = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&frozen);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(upstream).await else {
                return;
            };
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(pump(cr, sw, Arc::clone(&flag)));
            tokio::spawn(pump(sr, cw, Arc::clone(&flag)));
        }
    });
    (addr, frozen)
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        while frozen.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stops_answering_fails_a_striped_call_at_its_deadline() {
    let (server, _remote) = server(Arc::new(AllowAll), None).await;
    let (relay, frozen) = freezing_relay(server.local_addr()).await;
    let c = client(&relay, None).await;
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 8);
    let all = ids(0..BLOCKS);
    for write in [true, false] {
        // A call opens (and pools) a connection per stripe, then the path freezes.
        frozen.store(false, Ordering::Relaxed);
        c.write(&RequestId::new("r"), &local, &all, &all, deadline())
            .await
            .unwrap();
        frozen.store(true, Ordering::Relaxed);
        let within = Duration::from_millis(500);
        let started = Instant::now();
        let result = if write {
            c.write(&RequestId::new("r"), &local, &all, &all, started + within)
                .await
        } else {
            c.read(&RequestId::new("r"), &local, &all, &all, started + within)
                .await
        };
        let err = result.unwrap_err();
        assert!(matches!(err, DataError::Timeout { .. }), "{err}");
        // It ends at its deadline, not long after: each stripe waits at most until then.
        let took = started.elapsed();
        assert!(
            took >= within && took < within + Duration::from_secs(2),
            "{took:?}"
        );
    }
    // A path that answers again serves calls again (on new connections).
    frozen.store(false, Ordering::Relaxed);
    c.write(&RequestId::new("r"), &local, &all, &all, deadline())
        .await
        .unwrap();
    assert!(server.stats().connections >= 2 * stripes_here());
}
