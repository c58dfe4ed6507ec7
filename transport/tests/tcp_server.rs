//! The TCP data transport in one process: transfers with checksums, refusals that leave the
//! connection and the server serving, and hostile bytes on the data port.

mod data_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use data_common::{checksum, fill, ids, Rng, TableGrants};
use handoff_transport::auth::Key;
use handoff_transport::data::{Access, AllowAll, DataError, GrantError, Grants, RefusalCode};
use handoff_transport::tcp::frame::{self, Header, Op, Segment, HEADER_BYTES};
use handoff_transport::tcp::{DataClient, DataServer, ServerConfig, OP_BYTES_MAX};
use handoff_transport::{BlockId, RankInfo, Region, RequestId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BLOCKS: u32 = 64;
const BLOCK_BYTES: usize = 64 * 1024;
const STEP: Duration = Duration::from_secs(20);

fn deadline() -> Instant {
    Instant::now() + STEP
}

async fn server(
    grants: Arc<dyn Grants>,
    key: Option<Key>,
    config: ServerConfig,
) -> (DataServer, Arc<Region>) {
    data_common::tcp_server(BLOCKS, BLOCK_BYTES, grants, key, config).await
}

async fn client(server: &DataServer, key: Option<Key>) -> DataClient {
    DataClient::connect(
        &server.local_addr().to_string(),
        RankInfo::single("prefill"),
        key,
        STEP,
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_read_a_permutation_with_matching_checksums() {
    let (server, remote) = server(Arc::new(AllowAll), None, ServerConfig::default()).await;
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 7);
    let c = client(&server, None).await;
    let src = ids(0..BLOCKS);
    let dst = Rng::new(1).permutation(BLOCKS);
    c.write(&RequestId::new("r"), &local, &src, &dst, deadline())
        .await
        .unwrap();
    assert_eq!(checksum(&remote, &dst), checksum(&local, &src));
    let back = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    let order = Rng::new(2).permutation(BLOCKS);
    c.read(&RequestId::new("r"), &back, &dst, &order, deadline())
        .await
        .unwrap();
    assert_eq!(checksum(&back, &order), checksum(&local, &src));
    // Contiguous runs coalesce and split at the op maximum: one 4 MiB run = 1 op, a
    // whole-region run = several.
    c.write(&RequestId::new("r"), &local, &src, &src, deadline())
        .await
        .unwrap();
    assert_eq!(checksum(&remote, &src), checksum(&local, &src));
    assert!(server.stats().writes >= (BLOCKS as u64 * BLOCK_BYTES as u64) / OP_BYTES_MAX as u64);
    assert_eq!(server.stats().refused, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tasks_share_one_client() {
    let (server, remote) = server(Arc::new(AllowAll), None, ServerConfig::default()).await;
    let local = Arc::new(Region::new(BLOCKS, BLOCK_BYTES).unwrap());
    fill(&local, 3);
    let c = client(&server, None).await;
    let mut tasks = Vec::new();
    for t in 0..16u32 {
        let (c, local) = (c.clone(), Arc::clone(&local));
        tasks.push(tokio::spawn(async move {
            let blocks: Vec<BlockId> = (t * 4..t * 4 + 4).map(BlockId).collect();
            c.write(
                &RequestId::new(format!("r{t}")),
                &local,
                &blocks,
                &blocks,
                deadline(),
            )
            .await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(
        checksum(&remote, &ids(0..BLOCKS)),
        checksum(&local, &ids(0..BLOCKS))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ungranted_and_out_of_range_blocks_are_refused_and_serving_goes_on() {
    let grants = Arc::new(TableGrants::default());
    grants.grant("r1", Access::Write, 0..8);
    grants.grant("r1", Access::Read, 8..16);
    let (server, remote) = server(grants, None, ServerConfig::default()).await;
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 11);
    let c = client(&server, None).await;
    let r1 = RequestId::new("r1");
    // Block 8 is granted for reading only: the write is refused, nothing is written.
    let err = c
        .write(&r1, &local, &ids(0..9), &ids(0..9), deadline())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, DataError::Refused { code: RefusalCode::NotGranted, peer, .. } if peer.contains("decode")),
        "{err}"
    );
    assert_eq!(
        checksum(&remote, &[BlockId(8)]),
        checksum(&Region::new(1, BLOCK_BYTES).unwrap(), &[BlockId(0)])
    );
    // Another request has no grant at all.
    let err = c
        .read(
            &RequestId::new("r2"),
            &local,
            &ids(8..9),
            &ids(0..1),
            deadline(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            DataError::Refused {
                code: RefusalCode::NotGranted,
                ..
            }
        ),
        "{err}"
    );
    // A block past the server's region is refused before anything is sent.
    let err = c
        .write(&r1, &local, &[BlockId(0)], &[BlockId(BLOCKS)], deadline())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            DataError::OutsidePeerRegion {
                block: BlockId(BLOCKS),
                ..
            }
        ),
        "{err}"
    );
    // A block past our own region too.
    let err = c
        .write(
            &r1,
            &local,
            &[BlockId(BLOCKS + 5)],
            &[BlockId(0)],
            deadline(),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, DataError::Region(_)), "{err}");
    // The granted transfers still work.
    c.write(&r1, &local, &ids(0..8), &ids(0..8), deadline())
        .await
        .unwrap();
    assert_eq!(checksum(&remote, &ids(0..8)), checksum(&local, &ids(0..8)));
    c.read(&r1, &local, &ids(8..16), &ids(40..48), deadline())
        .await
        .unwrap();
    assert_eq!(server.stats().refused, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_must_match() {
    let key = Key::new(b"0123456789abcdef").unwrap();
    let (server, remote) = server(
        Arc::new(AllowAll),
        Some(key.clone()),
        ServerConfig::default(),
    )
    .await;
    let addr = server.local_addr().to_string();
    let bare = DataClient::connect(&addr, RankInfo::single("p"), None, STEP)
        .await
        .unwrap_err();
    assert!(
        matches!(
            bare,
            DataError::Refused {
                code: RefusalCode::AuthFailed,
                ..
            }
        ),
        "{bare}"
    );
    let wrong = Key::new(b"0123456789abcdeX").unwrap();
    let err = DataClient::connect(&addr, RankInfo::single("p"), Some(wrong), STEP)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            DataError::Refused {
                code: RefusalCode::AuthFailed,
                ..
            } | DataError::Auth { .. }
        ),
        "{err}"
    );
    let c = client(&server, Some(key)).await;
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 5);
    c.write(
        &RequestId::new("r"),
        &local,
        &ids(0..4),
        &ids(10..14),
        deadline(),
    )
    .await
    .unwrap();
    assert_eq!(
        checksum(&remote, &ids(10..14)),
        checksum(&local, &ids(0..4))
    );
}

/// A raw connection that has said hello, for hand-made frames.
async fn raw_hello(server: &DataServer) -> (TcpStream, [u8; 16]) {
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    let meta = frame::encode_hello(&RankInfo::single("raw"));
    let h = Header {
        op: Op::Hello,
        flags: 0,
        seq: 0,
        meta_len: meta.len() as u32,
        data_len: 0,
    };
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(&meta).await.unwrap();
    let (head, meta) = read_frame(&mut s).await.unwrap();
    assert_eq!(head.op, Op::HelloOk);
    (s, frame::decode_hello_ok(&meta).unwrap().nonce)
}

async fn read_frame(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
    let mut h = [0u8; HEADER_BYTES];
    tokio::time::timeout(STEP, s.read_exact(&mut h))
        .await
        .ok()?
        .ok()?;
    let head = Header::check(&h).unwrap();
    let mut meta = vec![0u8; head.meta_len as usize];
    s.read_exact(&mut meta).await.ok()?;
    Some((head, meta))
}

async fn expect_refusal_then_close(s: &mut TcpStream, code: RefusalCode) {
    let (head, meta) = read_frame(s).await.expect("an Error frame");
    assert_eq!(head.op, Op::Error);
    assert_eq!(frame::decode_error(&meta).unwrap().0, code.to_wire());
    let mut rest = [0u8; 1];
    let n = tokio::time::timeout(STEP, s.read(&mut rest))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "closed after a malformed frame");
}

async fn still_serves(server: &DataServer, remote: &Region) {
    let c = client(server, None).await;
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 99);
    c.write(
        &RequestId::new("ok"),
        &local,
        &ids(0..2),
        &ids(20..22),
        deadline(),
    )
    .await
    .unwrap();
    assert_eq!(checksum(remote, &ids(20..22)), checksum(&local, &ids(0..2)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_truncated_and_oversized_frames_are_refused_and_the_server_goes_on() {
    let config = ServerConfig {
        frame_read_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(600),
        ..ServerConfig::default()
    };
    let (server, remote) = server(Arc::new(AllowAll), None, config).await;

    // Not our protocol at all.
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    expect_refusal_then_close(&mut s, RefusalCode::Malformed).await;
    still_serves(&server, &remote).await;

    // A header announcing more data than an operation may carry: refused on the header.
    let (mut s, _) = raw_hello(&server).await;
    let h = Header {
        op: Op::Write,
        flags: 0,
        seq: 1,
        meta_len: 0,
        data_len: 0,
    }
    .encode();
    let mut big = h;
    big[16..20].copy_from_slice(&(OP_BYTES_MAX as u32 + 1).to_le_bytes());
    s.write_all(&big).await.unwrap();
    expect_refusal_then_close(&mut s, RefusalCode::Malformed).await;
    let mut big = h;
    big[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    let (mut s, _) = raw_hello(&server).await;
    s.write_all(&big).await.unwrap();
    expect_refusal_then_close(&mut s, RefusalCode::Malformed).await;
    still_serves(&server, &remote).await;

    // A truncated frame: a write announcing 64 KiB that sends 100 bytes and hangs up.
    let (mut s, _) = raw_hello(&server).await;
    let mut meta = Vec::new();
    frame::encode_op(
        &RequestId::new("t"),
        [Segment {
            offset: 0,
            len: 65536,
        }]
        .into_iter(),
        &mut meta,
    );
    let h = Header {
        op: Op::Write,
        flags: 0,
        seq: 1,
        meta_len: meta.len() as u32,
        data_len: 65536,
    };
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(&meta).await.unwrap();
    s.write_all(&[1u8; 100]).await.unwrap();
    drop(s);
    // The same, stalled instead of closed: the server gives up after its frame timeout.
    let (mut s, _) = raw_hello(&server).await;
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(&meta).await.unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(STEP, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => continue,
            }
        }
    })
    .await;
    assert!(
        closed.is_ok() && started.elapsed() < Duration::from_secs(5),
        "stalled frame dropped"
    );
    // Half a header, then silence: dropped after the idle/frame limits.
    let (mut s, _) = raw_hello(&server).await;
    s.write_all(&h.encode()[..10]).await.unwrap();
    let closed = tokio::time::timeout(STEP, s.read(&mut buf)).await;
    assert!(closed.is_ok(), "half a header is not held forever");
    still_serves(&server, &remote).await;

    // Well-formed frames with bad contents are refused per operation; the connection goes on.
    let (mut s, nonce) = raw_hello(&server).await;
    let _ = nonce;
    let past_end = (BLOCKS as u64) * BLOCK_BYTES as u64 - 10;
    frame::encode_op(
        &RequestId::new("t"),
        [Segment {
            offset: past_end,
            len: 20,
        }]
        .into_iter(),
        &mut meta,
    );
    let h = Header {
        op: Op::Write,
        flags: 0,
        seq: 1,
        meta_len: meta.len() as u32,
        data_len: 20,
    };
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(&meta).await.unwrap();
    s.write_all(&[7u8; 20]).await.unwrap();
    let (head, m) = read_frame(&mut s).await.unwrap();
    assert_eq!((head.op, head.seq), (Op::Error, 1));
    assert_eq!(
        frame::decode_error(&m).unwrap().0,
        RefusalCode::OutOfRange.to_wire()
    );
    // Segments that do not add up to the data length.
    frame::encode_op(
        &RequestId::new("t"),
        [Segment { offset: 0, len: 10 }].into_iter(),
        &mut meta,
    );
    let h = Header {
        op: Op::Write,
        flags: 0,
        seq: 2,
        meta_len: meta.len() as u32,
        data_len: 20,
    };
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(&meta).await.unwrap();
    s.write_all(&[7u8; 20]).await.unwrap();
    let (head, m) = read_frame(&mut s).await.unwrap();
    assert_eq!((head.op, head.seq), (Op::Error, 2));
    assert_eq!(
        frame::decode_error(&m).unwrap().0,
        RefusalCode::Malformed.to_wire()
    );
    // Then a good write on the same connection.
    frame::encode_op(
        &RequestId::new("t"),
        [Segment { offset: 0, len: 20 }].into_iter(),
        &mut meta,
    );
    let h = Header {
        op: Op::Write,
        flags: 0,
        seq: 3,
        meta_len: meta.len() as u32,
        data_len: 20,
    };
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(&meta).await.unwrap();
    s.write_all(&[7u8; 20]).await.unwrap();
    let (head, _) = read_frame(&mut s).await.unwrap();
    assert_eq!((head.op, head.seq), (Op::WriteOk, 3));
    assert_eq!(&remote.read_block(BlockId(0)).unwrap()[..20], &[7u8; 20]);
    // Nothing was written past the region's end (the region is the whole allocation).
    assert!(server.stats().refused >= 2);
    assert!(server.stats().dropped_connections >= 3);
    still_serves(&server, &remote).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_at_its_connection_limit_answers_busy() {
    let config = ServerConfig {
        connections_max: 1,
        ..ServerConfig::default()
    };
    let (server, _remote) = server(Arc::new(AllowAll), None, config).await;
    let _first = client(&server, None).await;
    let err = DataClient::connect(
        &server.local_addr().to_string(),
        RankInfo::single("p2"),
        None,
        STEP,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            DataError::Refused {
                code: RefusalCode::Busy,
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_server_fails_calls_promptly_and_a_dead_address_fails_to_connect() {
    let (server, _remote) = server(Arc::new(AllowAll), None, ServerConfig::default()).await;
    let addr = server.local_addr().to_string();
    let c = client(&server, None).await;
    drop(server);
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    let started = Instant::now();
    // Dropping the server aborts its connection tasks asynchronously: a write already on
    // an open connection may still be served once. What must hold is that calls fail, and
    // promptly.
    let err = loop {
        let result = c
            .write(
                &RequestId::new("r"),
                &local,
                &ids(0..4),
                &ids(0..4),
                deadline(),
            )
            .await;
        match result {
            Err(err) => break err,
            Ok(()) => assert!(
                started.elapsed() < Duration::from_secs(5),
                "calls still served 5 s after the drop"
            ),
        }
        tokio::task::yield_now().await;
    };
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{err} took {:?}",
        started.elapsed()
    );
    let err = DataClient::connect(&addr, RankInfo::single("p"), None, Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(matches!(err, DataError::Connect { .. }), "{err}");
}

/// KV caches as engines hold them on both ends of a TCP transfer: the server's region is
/// 8 layers of per-layer K and V halves (16 ranges), the client's the same layers
/// interleaved (8 ranges). Whole-block writes and reads of a permutation, and a layer
/// slice (the second half of the layers, as a pipeline stage moves it), land byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_move_between_regions_of_different_layouts() {
    use handoff_transport::{BlockSlice, KvLayout, KvShape};
    let (layers, half) = (8, BLOCK_BYTES / 16);
    let remote =
        Arc::new(Region::alloc(KvLayout::shaped(KvShape::KvHalves, layers, BLOCKS, half)).unwrap());
    let server = DataServer::bind(
        "127.0.0.1:0",
        Arc::clone(&remote),
        Arc::new(AllowAll),
        RankInfo::single("decode"),
        None,
    )
    .await
    .unwrap();
    let local =
        Region::alloc(KvLayout::shaped(KvShape::LayerBlocks, layers, BLOCKS, half)).unwrap();
    assert_eq!(local.block_bytes(), BLOCK_BYTES);
    fill(&local, 21);
    let c = client(&server, None).await;
    let (src, dst) = (ids(0..BLOCKS), Rng::new(5).permutation(BLOCKS));
    let r = RequestId::new("r");
    c.write(&r, &local, &src, &dst, deadline()).await.unwrap();
    assert_eq!(checksum(&remote, &dst), checksum(&local, &src));
    let back = Region::alloc(KvLayout::shaped(KvShape::KvHalves, layers, BLOCKS, half)).unwrap();
    c.read(&r, &back, &dst, &src, deadline()).await.unwrap();
    assert_eq!(checksum(&back, &src), checksum(&local, &src));
    // Layers 4..8 of local block 3 into layers 4..8 of remote block 0, nothing else.
    let slice = BlockSlice {
        src_offset: BLOCK_BYTES / 2,
        dst_offset: BLOCK_BYTES / 2,
        len: BLOCK_BYTES / 2,
    };
    let before = remote.read_block(BlockId(0)).unwrap();
    c.write_slices(
        &r,
        &local,
        &[BlockId(3)],
        &[BlockId(0)],
        &[slice],
        deadline(),
    )
    .await
    .unwrap();
    let after = remote.read_block(BlockId(0)).unwrap();
    let want = local.read_block(BlockId(3)).unwrap();
    assert_eq!(after[..BLOCK_BYTES / 2], before[..BLOCK_BYTES / 2]);
    assert_eq!(after[BLOCK_BYTES / 2..], want[BLOCK_BYTES / 2..]);
    // Two slices of two blocks in one call, each to its own offset (TP heads): only they
    // move, and a read of the same slices brings them back.
    let eighth = BLOCK_BYTES / 8;
    let slices = [
        BlockSlice {
            src_offset: 0,
            dst_offset: 2 * eighth,
            len: eighth,
        },
        BlockSlice {
            src_offset: 4 * eighth,
            dst_offset: 0,
            len: eighth,
        },
    ];
    slices_round_trip(
        &c,
        &local,
        &remote,
        &[BlockId(5), BlockId(6)],
        &[BlockId(1), BlockId(2)],
        &slices,
    )
    .await;
}

/// Writes `slices` of our `src` blocks into the server's `dst` blocks in one call, checks
/// that each server block is what it was with those slices replaced, then reads the same
/// slices back into fresh blocks and checks them (in a read the source is the server's
/// block: its `src_offset` into our `dst_offset`).
async fn slices_round_trip(
    c: &DataClient,
    local: &Region,
    remote: &Region,
    src: &[BlockId],
    dst: &[BlockId],
    slices: &[handoff_transport::BlockSlice],
) {
    let r = RequestId::new("slices");
    let before: Vec<Vec<u8>> = dst.iter().map(|b| remote.read_block(*b).unwrap()).collect();
    c.write_slices(&r, local, src, dst, slices, deadline())
        .await
        .unwrap();
    for (k, (s, d)) in src.iter().zip(dst).enumerate() {
        let mut want = before[k].clone();
        let from = local.read_block(*s).unwrap();
        for sl in slices {
            want[sl.dst_offset..sl.dst_offset + sl.len]
                .copy_from_slice(&from[sl.src_offset..sl.src_offset + sl.len]);
        }
        assert!(remote.read_block(*d).unwrap() == want, "block {d:?}");
    }
    let back = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    c.read_slices(&r, &back, dst, src, slices, deadline())
        .await
        .unwrap();
    for (s, d) in src.iter().zip(dst) {
        let (got, from) = (back.read_block(*s).unwrap(), remote.read_block(*d).unwrap());
        for sl in slices {
            assert!(
                got[sl.dst_offset..sl.dst_offset + sl.len]
                    == from[sl.src_offset..sl.src_offset + sl.len],
                "block {s:?}, {sl:?}"
            );
        }
    }
}

/// More block-slice pairs than one plan holds (64 blocks × 5,000 slices of 8 bytes, each
/// to the mirrored offset, as token-major heads between TP sizes make them): the call runs
/// as several plans and every byte lands where its slice says, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_slices_than_one_plan_holds_land_byte_for_byte() {
    use handoff_transport::BlockSlice;
    const SLICES: usize = 5_000;
    const LEN: usize = 8;
    assert!(BLOCKS as usize * SLICES > handoff_transport::tcp::PLAN_PAIRS_MAX);
    let (server, remote) = server(Arc::new(AllowAll), None, ServerConfig::default()).await;
    let c = client(&server, None).await;
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 11);
    let slices: Vec<BlockSlice> = (0..SLICES)
        .map(|k| BlockSlice {
            src_offset: k * LEN,
            dst_offset: (SLICES - 1 - k) * LEN,
            len: LEN,
        })
        .collect();
    let (src, dst) = (ids(0..BLOCKS), Rng::new(5).permutation(BLOCKS));
    slices_round_trip(&c, &local, &remote, &src, &dst, &slices).await;
    // Past the bound on slices of a call: refused by name, nothing sent.
    let max = handoff_transport::data::SLICES_PER_CALL_MAX;
    let one = BlockSlice {
        src_offset: 0,
        dst_offset: 0,
        len: 1,
    };
    let too_many = vec![one; max + 1];
    let err = c
        .write_slices(
            &RequestId::new("too-many"),
            &local,
            &src[..1],
            &dst[..1],
            &too_many,
            deadline(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, DataError::TooLarge { count, .. } if count == max + 1),
        "{err}"
    );
}

/// A relay that records the bytes its one client sends to `upstream`.
async fn recording_relay(
    upstream: std::net::SocketAddr,
) -> (String, Arc<std::sync::Mutex<Vec<u8>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = log.clone();
    tokio::spawn(async move {
        let Ok((client, _)) = listener.accept().await else {
            return;
        };
        let Ok(server) = TcpStream::connect(upstream).await else {
            return;
        };
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        let up = async move {
            let mut buf = vec![0u8; 1 << 16];
            while let Ok(n) = cr.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                record.lock().unwrap().extend_from_slice(&buf[..n]);
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
async fn a_captured_keyed_connection_replayed_writes_nothing() {
    let key = Key::new(b"data-plane-secret-0123456789").unwrap();
    let (server, remote) = server(
        Arc::new(AllowAll),
        Some(key.clone()),
        ServerConfig::default(),
    )
    .await;
    let (relay, log) = recording_relay(server.local_addr()).await;
    let c = DataClient::connect(&relay, RankInfo::single("prefill"), Some(key), STEP)
        .await
        .unwrap();
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 9);
    c.write(
        &RequestId::new("r"),
        &local,
        &ids(0..2),
        &ids(20..22),
        deadline(),
    )
    .await
    .unwrap();
    assert_eq!(
        checksum(&remote, &ids(20..22)),
        checksum(&local, &ids(0..2))
    );
    let writes = server.stats().writes;
    // Clear the destination, then replay the whole capture on a new connection: the server
    // answers its handshake with a fresh ephemeral, so the captured Hello and writes do not
    // open, and nothing is written.
    for b in ids(20..22) {
        remote.write_block(b, &vec![0u8; BLOCK_BYTES]).unwrap();
    }
    let before = checksum(&remote, &ids(20..22));
    let captured = log.lock().unwrap().clone();
    let mut replay = TcpStream::connect(server.local_addr()).await.unwrap();
    replay.write_all(&captured).await.unwrap();
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(STEP, replay.read_to_end(&mut sink)).await;
    assert_eq!(
        server.stats().writes,
        writes,
        "a replayed write was performed"
    );
    assert_eq!(checksum(&remote, &ids(20..22)), before);
    assert!(server.stats().dropped_connections >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_that_never_say_hello_cannot_lock_a_peer_out() {
    let config = ServerConfig {
        connections_max: 4,
        ..ServerConfig::default()
    };
    let (server, remote) = server(Arc::new(AllowAll), None, config).await;
    let mut idle = Vec::new();
    for _ in 0..10 {
        idle.push(TcpStream::connect(server.local_addr()).await.unwrap());
    }
    // A peer's new connection gets through, evicting the oldest stranger.
    let c = client(&server, None).await;
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 3);
    c.write(
        &RequestId::new("r"),
        &local,
        &ids(0..2),
        &ids(4..6),
        deadline(),
    )
    .await
    .unwrap();
    assert_eq!(checksum(&remote, &ids(4..6)), checksum(&local, &ids(0..2)));
    assert!(server.stats().evicted >= 1, "{:?}", server.stats());
}

/// A raw connection to `server` from the loopback address `source` (every 127/8 address
/// reaches the server's 127.0.0.1), saying nothing.
async fn silent_from(server: &DataServer, source: [u8; 4]) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(std::net::SocketAddr::from((source, 0)))
        .unwrap();
    socket.connect(server.local_addr()).await.unwrap()
}

/// Waits (bounded) until the server has accepted `n` connections.
async fn accepted(server: &DataServer, n: u64) {
    let until = deadline();
    while server.stats().connections < n {
        assert!(Instant::now() < until, "{:?}", server.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One address that floods the server with connections that never say hello evicts only
/// its own: another address's connection, still in its handshake, is never pushed out,
/// and a peer's transfers go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_one_address_evicts_only_its_own_connections() {
    let config = ServerConfig {
        connections_max: 16,
        pending_per_source_max: 4,
        ..ServerConfig::default()
    };
    let (server, remote) = server(Arc::new(AllowAll), None, config).await;
    // A newcomer from another address that has not said hello yet.
    let _slow = silent_from(&server, [127, 0, 0, 3]).await;
    accepted(&server, 1).await;
    let mut flood = Vec::new();
    for _ in 0..40 {
        flood.push(silent_from(&server, [127, 0, 0, 2]).await);
    }
    accepted(&server, 41).await;
    let stats = server.stats();
    assert!(stats.evicted_per_source >= 36, "{stats:?}");
    // Every eviction was the flooder's own: the other address kept its place.
    assert_eq!(stats.evicted, stats.evicted_per_source, "{stats:?}");
    let c = client(&server, None).await;
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 5);
    c.write(
        &RequestId::new("r"),
        &local,
        &ids(0..2),
        &ids(8..10),
        deadline(),
    )
    .await
    .unwrap();
    assert_eq!(checksum(&remote, &ids(8..10)), checksum(&local, &ids(0..2)));
}

/// Grants every read, but says a read's grant ended (`Revoked`) or was made anew (another
/// generation) by the time anyone asks a second time about request `ends`: a server asks
/// before a read's first byte and after its last.
struct EndsDuringTheRead {
    ends: RequestId,
    anew: bool,
    asked: std::sync::Mutex<u32>,
}

impl Grants for EndsDuringTheRead {
    fn with_grant(
        &self,
        peer: &RankInfo,
        request: &RequestId,
        access: Access,
        blocks: &[BlockId],
        f: &mut dyn FnMut(),
    ) -> Result<(), GrantError> {
        self.generation(peer, request, access, blocks).map(|_| f())
    }

    fn generation(
        &self,
        _peer: &RankInfo,
        request: &RequestId,
        _access: Access,
        _blocks: &[BlockId],
    ) -> Result<u64, GrantError> {
        if *request != self.ends {
            return Ok(1);
        }
        let mut asked = self.asked.lock().unwrap();
        *asked += 1;
        match (*asked, self.anew) {
            (1, _) => Ok(1),
            (_, true) => Ok(2),
            (_, false) => Err(GrantError::Revoked {
                request: request.clone(),
            }),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_whose_grant_ends_while_its_bytes_are_sent_is_refused_not_taken() {
    for anew in [false, true] {
        let grants = Arc::new(EndsDuringTheRead {
            ends: RequestId::new("ends"),
            anew,
            asked: Default::default(),
        });
        let (server, remote) = server(grants.clone(), None, ServerConfig::default()).await;
        fill(&remote, 5);
        let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
        let c = client(&server, None).await;
        let err = c
            .read(
                &RequestId::new("ends"),
                &local,
                &ids(0..8),
                &ids(0..8),
                deadline(),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, DataError::Refused { code: RefusalCode::NotGranted, detail, .. } if detail.contains("while its bytes were sent")),
            "anew {anew}: {err}"
        );
        // Asked before the first byte and after the last: the bytes were sent, then disowned.
        assert_eq!(*grants.asked.lock().unwrap(), 2);
        assert_eq!((server.stats().reads, server.stats().refused), (0, 1));
        // The connection and the server go on: another request's read is confirmed.
        c.read(
            &RequestId::new("stays"),
            &local,
            &ids(8..16),
            &ids(8..16),
            deadline(),
        )
        .await
        .unwrap();
        assert_eq!(
            checksum(&local, &ids(8..16)),
            checksum(&remote, &ids(8..16))
        );
        assert_eq!(server.stats().reads, 1);
    }
}

/// A read races its grant's end, as a prefill whose request ends (and whose engine reuses
/// the blocks) while decode reads them: the revocation lands before the read, during it,
/// or after it. Whatever the timing, a read that succeeds holds the blocks as they were
/// granted, never bytes the engine wrote after the revocation; one that does not is
/// refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_racing_its_revocation_is_whole_or_refused() {
    let table = Arc::new(handoff_transport::data::GrantTable::default());
    let (server, remote) = server(table.clone(), None, ServerConfig::default()).await;
    let c = client(&server, None).await;
    let local = Arc::new(Region::new(BLOCKS, BLOCK_BYTES).unwrap());
    let all = ids(0..BLOCKS);
    let reader = RankInfo::single("prefill");
    // Time one whole read first, to spread the revocations over its span and past it.
    let id = RequestId::new("timing");
    table.grant(&reader, &id, Access::Read, &all);
    let started = Instant::now();
    c.read(&id, &local, &all, &all, deadline()).await.unwrap();
    let span = started.elapsed().max(Duration::from_micros(200));
    table.revoke(&id);
    let rounds = 60u32;
    let (mut whole, mut refused) = (0u32, 0u32);
    for round in 0..rounds {
        let granted_seed = 1000 + u64::from(round);
        fill(&remote, granted_seed);
        let id = RequestId::new(format!("r{round}"));
        table.grant(&reader, &id, Access::Read, &all);
        // From before the read starts (round 0) to well after its usual end.
        let delay = span * round * 3 / (2 * rounds);
        let (ender_table, ender_id, ender_region) = (table.clone(), id.clone(), remote.clone());
        // The engine's next request, ready to be written (last block first, so it lands
        // ahead of a read still sending in block order).
        let next = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
        fill(&next, granted_seed + 1_000_000);
        let next: Vec<Vec<u8>> = all.iter().map(|b| next.read_block(*b).unwrap()).collect();
        let ender = std::thread::spawn(move || {
            let until = Instant::now() + delay;
            while Instant::now() < until {
                std::hint::spin_loop();
            }
            ender_table.revoke(&ender_id);
            // The engine takes the blocks back and writes a new request's KV into them.
            for (b, bytes) in next.iter().enumerate().rev() {
                ender_region.write_block(BlockId(b as u32), bytes).unwrap();
            }
        });
        let read = c.read(&id, &local, &all, &all, deadline()).await;
        ender.join().unwrap();
        match read {
            Ok(()) => {
                let expected = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
                fill(&expected, granted_seed);
                assert_eq!(
                    checksum(&local, &all),
                    checksum(&expected, &all),
                    "round {round}: a read taken for good holds bytes written after its grant ended"
                );
                whole += 1;
            }
            Err(DataError::Refused {
                code: RefusalCode::NotGranted,
                ..
            }) => refused += 1,
            Err(e) => panic!("round {round}: {e}"),
        }
    }
    eprintln!("{whole} reads whole, {refused} refused, of {rounds}; one read {span:?}");
    assert_eq!(whole + refused, rounds);
}

/// A peer that asks for reads and never takes the bytes holds the connection no longer
/// than the frame time (each frame is answered under it): the server drops it (nothing is
/// locked meanwhile: the bytes go straight from the blocks) and goes on serving others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_never_takes_its_bytes_is_dropped_within_the_frame_time() {
    let config = ServerConfig {
        frame_read_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let (server, remote) = server(Arc::new(AllowAll), None, config).await;
    let (mut s, _) = raw_hello(&server).await;
    // The whole region, four times over, more than the sockets' buffers hold.
    let mut meta = Vec::new();
    let per_op = OP_BYTES_MAX / BLOCK_BYTES;
    for k in 0..4u32 {
        let segs = (0..per_op).map(|b| Segment {
            offset: (b as u64 % u64::from(BLOCKS)) * BLOCK_BYTES as u64,
            len: BLOCK_BYTES as u32,
        });
        frame::encode_op(&RequestId::new("r"), segs, &mut meta);
        let h = Header {
            op: Op::Read,
            flags: 0,
            seq: k + 1,
            meta_len: meta.len() as u32,
            data_len: 0,
        };
        s.write_all(&h.encode()).await.unwrap();
        s.write_all(&meta).await.unwrap();
    }
    let started = Instant::now();
    while server.stats().dropped_connections == 0 {
        assert!(
            started.elapsed() < STEP,
            "the stalled reader was never dropped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    still_serves(&server, &remote).await;
    drop(s);
}

/// A client and a server that wait for bytes busy-polling move the same bytes, write and
/// read, one block and many.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_polling_client_and_server_move_the_same_bytes() {
    let poll = Duration::from_micros(200);
    let config = ServerConfig {
        busy_poll: poll,
        ..ServerConfig::default()
    };
    let (server, remote) = server(Arc::new(AllowAll), None, config).await;
    let c = DataClient::connect_with(
        &server.local_addr().to_string(),
        RankInfo::single("prefill"),
        None,
        STEP,
        poll,
    )
    .await
    .unwrap();
    // A server in this process runs on the client's own runtime: its client never spins
    // (the two-process test checks one that does); this server does.
    assert_eq!(c.busy_poll(), Duration::ZERO);
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 21);
    let id = RequestId::new("poll");
    for b in 0..4 {
        c.write(&id, &local, &[BlockId(b)], &[BlockId(63 - b)], deadline())
            .await
            .unwrap();
    }
    let dst = Rng::new(3).permutation(BLOCKS);
    c.write(&id, &local, &ids(0..BLOCKS), &dst, deadline())
        .await
        .unwrap();
    assert_eq!(checksum(&remote, &dst), checksum(&local, &ids(0..BLOCKS)));
    let back = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    c.read(&id, &back, &dst, &ids(0..BLOCKS), deadline())
        .await
        .unwrap();
    assert_eq!(
        checksum(&back, &ids(0..BLOCKS)),
        checksum(&local, &ids(0..BLOCKS))
    );
}

/// A write lands straight in the blocks, a receive at a time, each under the grant: when
/// the grant ends half-way (the request ended on decode, whose engine is about to reuse the
/// blocks), the half already received stays, not one byte after the revocation lands, the
/// rest is read and dropped, the write is refused `NotGranted`, and the connection and the
/// server go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_grant_ends_half_way_lands_nothing_after_and_is_refused() {
    let table = Arc::new(handoff_transport::data::GrantTable::default());
    let (server, remote) = server(table.clone(), None, ServerConfig::default()).await;
    let id = RequestId::new("ends");
    table.grant(&RankInfo::single("raw"), &id, Access::Write, &ids(0..2));
    let (mut s, _) = raw_hello(&server).await;
    let mut meta = Vec::new();
    let segment = Segment {
        offset: 0,
        len: 2 * BLOCK_BYTES as u32,
    };
    frame::encode_op(&id, [segment].into_iter(), &mut meta);
    let head = Header {
        op: Op::Write,
        flags: 0,
        seq: 7,
        meta_len: meta.len() as u32,
        data_len: segment.len,
    };
    s.write_all(&head.encode()).await.unwrap();
    s.write_all(&meta).await.unwrap();
    let first = vec![0xabu8; BLOCK_BYTES];
    s.write_all(&first).await.unwrap();
    // The first half lands while the grant holds (waited for, under the step's deadline).
    let until = deadline();
    while remote.read_block(BlockId(0)).unwrap() != first {
        assert!(Instant::now() < until, "the first half never landed");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    table.revoke(&id);
    s.write_all(&vec![0xcdu8; BLOCK_BYTES]).await.unwrap();
    let (answer, refusal) = read_frame(&mut s).await.expect("an answer to the write");
    assert_eq!((answer.op, answer.seq), (Op::Error, 7));
    assert_eq!(
        frame::decode_error(&refusal).unwrap().0,
        RefusalCode::NotGranted.to_wire()
    );
    assert_eq!(remote.read_block(BlockId(0)).unwrap(), first);
    assert_eq!(
        remote.read_block(BlockId(1)).unwrap(),
        vec![0u8; BLOCK_BYTES],
        "a byte landed after the grant ended"
    );
    assert_eq!((server.stats().writes, server.stats().refused), (0, 1));
    // The same connection stays in step: its next write, granted, lands whole.
    let again = RequestId::new("again");
    table.grant(&RankInfo::single("raw"), &again, Access::Write, &ids(4..5));
    let segment = Segment {
        offset: 4 * BLOCK_BYTES as u64,
        len: BLOCK_BYTES as u32,
    };
    frame::encode_op(&again, [segment].into_iter(), &mut meta);
    let head = Header {
        seq: 8,
        meta_len: meta.len() as u32,
        data_len: segment.len,
        ..head
    };
    s.write_all(&head.encode()).await.unwrap();
    s.write_all(&meta).await.unwrap();
    s.write_all(&first).await.unwrap();
    let (answer, _) = read_frame(&mut s).await.expect("an answer to the write");
    assert_eq!((answer.op, answer.seq), (Op::WriteOk, 8));
    assert_eq!(remote.read_block(BlockId(4)).unwrap(), first);
    table.grant(
        &RankInfo::single("prefill"),
        &RequestId::new("ok"),
        Access::Write,
        &ids(20..22),
    );
    still_serves(&server, &remote).await;
}
