//! A transfer between two processes, from the library.
//!
//! This process runs a bootstrap server and a prefill runtime, then starts itself again as
//! the decode process. Both register, find each other through the bootstrap server, and
//! hand three requests over the network transport (ZMTP control channels, TCP data plane);
//! decode checks every block's bytes. Run with `cargo run --example two_process`.

use std::sync::Arc;
use std::time::Duration;

use handoff::actors::{
    BlockId, EngineId, RankInfo, ReceiverSpec, Region, RequestId, Role, Runtime, State,
    TransportChoice,
};
use handoff::bootstrap::{serve, BootstrapClient, ClientConfig, ServerConfig};
use handoff::net::tcp::TcpDataPlane;
use handoff::net::{NetConfig, NetTransport};

const BLOCKS: u32 = 16;
const BLOCK_BYTES: usize = 64 * 1024;
const REQUESTS: u32 = 3;
const DECODE_ENV: &str = "HANDOFF_EXAMPLE_BOOTSTRAP";

/// What prefill writes into block `k` of request `id`, and decode expects.
fn pattern(id: &RequestId, k: usize) -> Vec<u8> {
    let seed = handoff::gpu::checksum64(id.as_str().as_bytes()) ^ k as u64;
    let mut bytes = vec![0u8; BLOCK_BYTES];
    handoff::gpu::checksum::fill_pattern(&mut bytes, seed, 0);
    bytes
}

async fn runtime(
    role: Role,
    engine: &str,
    bootstrap: &str,
) -> Result<Runtime, Box<dyn std::error::Error>> {
    let rank = RankInfo::single(engine);
    let region = Arc::new(Region::new(BLOCKS, BLOCK_BYTES)?);
    let data = TcpDataPlane::bind("127.0.0.1:0", None, region.clone(), rank.clone(), None).await?;
    let directory = Arc::new(BootstrapClient::new(
        bootstrap,
        None,
        ClientConfig::default(),
    ));
    let net = NetTransport::bind(
        NetConfig::default(),
        rank.clone(),
        role,
        directory,
        Arc::new(data),
    )
    .await?;
    Ok(Runtime::builder(role, rank)
        .transport(TransportChoice::Custom(Arc::new(net)))
        .region(region)
        .start()
        .await?)
}

async fn decode(bootstrap: &str) -> Result<(), Box<dyn std::error::Error>> {
    let d = runtime(Role::Decode, "decode-0", bootstrap).await?;
    for n in 0..REQUESTS {
        let id = RequestId::new(format!("req-{n}"));
        let blocks: Vec<BlockId> = (0..4).map(|k| BlockId(n * 4 + k)).collect();
        let spec = ReceiverSpec {
            prefill: EngineId::new("prefill-0"),
            prefill_dp_rank: None,
            blocks: Some(blocks.clone()),
        };
        let r = d.receiver(id.clone(), spec)?;
        let end = tokio::time::timeout(Duration::from_secs(30), r.completion()).await?;
        let intact = blocks.iter().enumerate().all(|(k, b)| {
            d.region()
                .read_block(*b)
                .is_ok_and(|got| got == pattern(&id, k))
        });
        println!(
            "decode:  {id} {end}, bytes {}",
            if intact { "intact" } else { "CORRUPTED" }
        );
        if end != State::Done || !intact {
            return Err(format!("{id} did not arrive intact").into());
        }
    }
    d.shutdown().await;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Ok(bootstrap) = std::env::var(DECODE_ENV) {
        return decode(&bootstrap).await;
    }
    let server = serve(ServerConfig::new("tcp://127.0.0.1:0")).await?;
    let bootstrap = server.address();
    println!("bootstrap server on {bootstrap}");
    let p = runtime(Role::Prefill, "prefill-0", &bootstrap).await?;
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .env(DECODE_ENV, &bootstrap)
        .spawn()?;
    for n in 0..REQUESTS {
        let id = RequestId::new(format!("req-{n}"));
        let blocks: Vec<BlockId> = (0..4).map(|k| BlockId(8 + n % 2 * 4 + k)).collect();
        for (k, b) in blocks.iter().enumerate() {
            p.region().write_block(*b, &pattern(&id, k))?;
        }
        let s = p.sender(id.clone())?;
        s.send(blocks)?;
        let end = tokio::time::timeout(Duration::from_secs(30), s.completion()).await?;
        println!("prefill: {id} {end}");
    }
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await??;
    p.shutdown().await;
    server.stop().await;
    if !status.success() {
        return Err("the decode process failed".into());
    }
    println!("three requests handed over between two processes");
    Ok(())
}
