//! Requests end to end over the network transport: ZMTP control channels, the TCP data
//! plane, real bytes, on loopback; both modes; and grants that end with their requests.

use std::sync::Arc;
use std::time::Duration;

use handoff_actors::{
    BlockId, EngineId, RankInfo, ReceiverSpec, Region, Role, Runtime, State, TransferMode,
    TransportChoice,
};
use handoff_net::tcp::TcpDataPlane;
use handoff_net::{DataPlane, NetConfig, NetTransport, StaticDirectory};

const BLOCK_BYTES: usize = 64 * 1024;
const T: Duration = Duration::from_secs(20);

async fn worker(
    dir: &Arc<StaticDirectory>,
    role: Role,
    engine: &str,
    mode: TransferMode,
) -> (Runtime, Arc<TcpDataPlane>) {
    let rank = RankInfo::single(engine);
    let region = Arc::new(Region::new(64, BLOCK_BYTES).unwrap());
    let data = Arc::new(
        TcpDataPlane::bind("127.0.0.1:0", None, region.clone(), rank.clone(), None)
            .await
            .unwrap(),
    );
    let cfg = NetConfig {
        heartbeat_interval: Duration::from_millis(200),
        heartbeats_missed_max: 5,
        ..NetConfig::default()
    };
    let net = NetTransport::bind(cfg, rank.clone(), role, dir.clone(), data.clone())
        .await
        .unwrap();
    let rt = Runtime::builder(role, rank)
        .mode(mode)
        .transport(TransportChoice::Custom(Arc::new(net)))
        .region(region)
        .start()
        .await
        .unwrap();
    (rt, data)
}

async fn hands_over(mode: TransferMode) {
    let dir = Arc::new(StaticDirectory::new());
    let (p, p_data) = worker(&dir, Role::Prefill, "P", mode).await;
    let (d, d_data) = worker(&dir, Role::Decode, "D", mode).await;
    let mut pairs = Vec::new();
    for i in 0..6u32 {
        let src: Vec<BlockId> = (i * 4..i * 4 + 4).map(BlockId).collect();
        // Descending destinations, distinct per request, so nothing coalesces by accident.
        let dst: Vec<BlockId> = (0..4).map(|k| BlockId(63 - (i * 4 + k))).collect();
        for (k, b) in src.iter().enumerate() {
            let byte = (i * 16 + k as u32) as u8;
            let data: Vec<u8> = (0..BLOCK_BYTES).map(|j| byte ^ (j as u8)).collect();
            p.region().write_block(*b, &data).unwrap();
        }
        let id = format!("req-{i}");
        let r = d
            .receiver(
                id.as_str(),
                ReceiverSpec {
                    prefill: EngineId::new("P"),
                    prefill_dp_rank: None,
                    blocks: Some(dst.clone()),
                },
            )
            .unwrap();
        let s = p.sender(id.as_str()).unwrap();
        s.send(src.clone()).unwrap();
        pairs.push((s, r, src, dst));
    }
    for (s, r, src, dst) in &pairs {
        assert_eq!(
            tokio::time::timeout(T, r.completion()).await.unwrap(),
            State::Done,
            "decode {}",
            r.id()
        );
        assert_eq!(
            tokio::time::timeout(T, s.completion()).await.unwrap(),
            State::Done,
            "prefill {}",
            s.id()
        );
        let sent = p.region().checksum(src).unwrap();
        let arrived = d.region().checksum(dst).unwrap();
        assert_eq!(
            sent,
            arrived,
            "{}: bytes on decode differ from prefill's",
            r.id()
        );
    }
    // Every grant ended with its request.
    assert!(p_data.grants().is_empty() && d_data.grants().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_over_tcp_moves_the_bytes() {
    hands_over(TransferMode::Push).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_over_tcp_moves_the_bytes() {
    hands_over(TransferMode::Pull).await;
}

/// A TCP write is applied by the peer's server only under its grant, but one whose answer
/// the writer sees only after its lease with the peer ended (it was stopped past the peer's
/// loss timeout, say) may be one the peer has failed since: it is not done
/// (`DataError::ConfirmedLate`), as over UCX. Within the lease, the same write is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_write_seen_done_only_after_its_lease_ended_is_not_done() {
    use handoff_actors::link::TransferError;
    use handoff_actors::RequestId;
    use handoff_net::{Access, PlaneTransfer};
    use handoff_transport::data::DataError;
    use handoff_transport::lease::Lease;
    use handoff_transport::region::BlockSlice;

    let plane = |name: &str| {
        let rank = RankInfo::single(name);
        let region = Arc::new(Region::new(8, BLOCK_BYTES).unwrap());
        async move {
            TcpDataPlane::bind("127.0.0.1:0", None, region, rank, None)
                .await
                .unwrap()
        }
    };
    let (writer, target) = (plane("P").await, plane("D").await);
    let (p, d) = (RankInfo::single("P"), RankInfo::single("D"));
    let (descriptor, data) = (target.descriptor(), target.data_descriptor());
    let blocks: Vec<BlockId> = (0..4).map(BlockId).collect();
    let write = |id: &'static str, lease: Arc<Lease>| {
        let id = RequestId::new(id);
        target.grants().grant(&p, &id, Access::Write, &blocks);
        let t = PlaneTransfer {
            id: &id,
            peer: &d,
            peer_data: &data,
            peer_layout: &descriptor,
            src: blocks.clone(),
            dst: blocks.clone(),
            slices: vec![BlockSlice::whole(BLOCK_BYTES)],
            lease: Some(lease),
            deadline: std::time::Instant::now() + T,
            process: None,
        };
        writer.write(t)
    };
    let held = Arc::new(Lease::new());
    held.extend_to(std::time::Instant::now() + T);
    let done = tokio::time::timeout(T, write("held", held)).await.unwrap();
    assert!(done.is_ok(), "{done:?}");
    // The peer's grant holds, so its server applies every operation; the lease has ended.
    let lapsed = Arc::new(Lease::new());
    let late = tokio::time::timeout(T, write("lapsed", lapsed))
        .await
        .unwrap();
    assert!(
        matches!(
            &late,
            Err(TransferError::Data(DataError::ConfirmedLate {
                ago: Some(_),
                ..
            }))
        ),
        "{late:?}"
    );
    // Revoked (the peer was lost): not done either, and the message says so.
    let revoked = Arc::new(Lease::new());
    revoked.extend_to(std::time::Instant::now() + T);
    revoked.revoke();
    let lost = tokio::time::timeout(T, write("revoked", revoked))
        .await
        .unwrap();
    let message = lost
        .map(|()| String::new())
        .unwrap_or_else(|e| e.to_string());
    assert!(message.contains("revoked"), "{message}");
}
