//! Embedding handoff in an engine loop, in one process.
//!
//! Two "engines" (one prefill, one decode) each run the loop an inference engine runs:
//! schedule, step, drain the runtime's events. Prefill hands its computed blocks to the
//! runtime with `send`; decode allocates destination blocks and opens a receiver. Each
//! step, both drain events (never blocking) to learn which requests finished or failed and
//! which blocks they may free. Run with `cargo run --example embed`.

use std::sync::Arc;
use std::time::Duration;

use handoff::actors::{
    BlockId, EngineId, Event, Fabric, RankInfo, ReceiverSpec, Region, Role, Runtime, State,
    TransportChoice,
};

const BLOCKS: u32 = 64;
const BLOCK_BYTES: usize = 4096;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fabric = Fabric::new();
    let runtime = |role, engine: &str| {
        Runtime::builder(role, RankInfo::single(engine))
            .transport(TransportChoice::InProcess(fabric.clone()))
            .region(Arc::new(
                Region::new(BLOCKS, BLOCK_BYTES).expect("valid region size"),
            ))
            .start()
    };
    let prefill = runtime(Role::Prefill, "p0").await?;
    let decode = runtime(Role::Decode, "d0").await?;

    // The engines' block managers.
    let mut prefill_free: Vec<BlockId> = (0..BLOCKS).map(BlockId).collect();
    let mut decode_free: Vec<BlockId> = (0..BLOCKS).map(BlockId).collect();
    let (total, mut finished) = (5, 0);

    for step in 0.. {
        // Schedule: one request per step. Decode allocates and opens a receiver; prefill
        // "computes" the KV cache into its blocks and hands them over.
        if step < total {
            let id = format!("req-{step}");
            let dst: Vec<BlockId> = decode_free.drain(..2).collect();
            let spec = ReceiverSpec {
                prefill: EngineId::new("p0"),
                prefill_dp_rank: None,
                blocks: Some(dst),
            };
            decode.receiver(id.as_str(), spec)?;
            let src: Vec<BlockId> = prefill_free.drain(..2).collect();
            for b in &src {
                prefill
                    .region()
                    .write_block(*b, &[step as u8; BLOCK_BYTES])?;
            }
            prefill.sender(id.as_str())?.send(src)?;
        }

        // Step: the model would run here.
        tokio::time::sleep(Duration::from_millis(1)).await;

        // Drain: finished and failed requests, and blocks to free.
        for event in prefill.drain_events() {
            if let Event::Released { id, blocks, .. } = event {
                println!(
                    "step {step}: prefill {id}: {} blocks free again",
                    blocks.len()
                );
                prefill_free.extend(blocks);
            }
        }
        for event in decode.drain_events() {
            match event {
                Event::State {
                    id,
                    state: State::Done,
                    ..
                } => {
                    println!("step {step}: decode  {id}: KV cache arrived, decoding can start");
                    finished += 1;
                }
                Event::State {
                    id,
                    state: State::Failed(reason),
                    ..
                } => {
                    println!("step {step}: decode  {id}: failed: {reason}");
                    finished += 1;
                }
                Event::State { id, state, .. } => println!("step {step}: decode  {id}: {state}"),
                Event::Released { blocks, .. } => decode_free.extend(blocks), // decoded at once
            }
        }
        if finished == total {
            break;
        }
    }
    prefill.shutdown().await;
    decode.shutdown().await;
    Ok(())
}
