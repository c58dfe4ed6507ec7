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
