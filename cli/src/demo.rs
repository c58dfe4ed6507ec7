//! The in-process demo behind `handoff demo`: a prefill runtime and a decode runtime in one
//! process, driven by an engine-like loop, handing over requests and printing each
//! request's lifecycle as the engine sees it (from drained events).
//!
//! The loop is what an embedding engine does each step: admit requests (decode allocates
//! destination blocks, prefill computes and hands its blocks over), then drain both
//! runtimes' events, free blocks the runtime released, and verify what arrived.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_actors::{
    BlockId, EngineId, Event, Fabric, RankInfo, ReceiverSpec, Region, RequestId, Role, Runtime,
    State, TransferMode, TransportChoice,
};

/// Blocks in each worker's KV pool.
const POOL_BLOCKS: u32 = 256;
/// Bytes per block: 16 tokens × 8 KV heads × 128 dims × 2 bytes (bf16) for one layer's K.
const BLOCK_BYTES: usize = 16 * 8 * 128 * 2;
/// Longest the demo waits for all requests before giving up (it never should).
const DEMO_DEADLINE: Duration = Duration::from_secs(30);
/// Pause between engine steps: an engine step takes tens of milliseconds.
const STEP: Duration = Duration::from_millis(2);

/// What to run.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// Requests to hand over.
    pub requests: u32,
    /// Blocks per request.
    pub blocks_per_request: u32,
    /// Push or pull.
    pub mode: TransferMode,
}

/// How the demo went.
#[derive(Debug, Default)]
pub struct DemoReport {
    /// Requests that arrived intact on decode.
    pub done: u32,
    /// Requests that failed, with the reason.
    pub failed: Vec<(RequestId, String)>,
    /// Requests whose bytes on decode differed from prefill's.
    pub corrupted: u32,
}

/// A free list of block ids: what an engine's block manager does.
struct Pool(Vec<BlockId>);

impl Pool {
    fn new() -> Self {
        Self((0..POOL_BLOCKS).rev().map(BlockId).collect())
    }

    fn take(&mut self, n: u32) -> Option<Vec<BlockId>> {
        (self.0.len() >= n as usize).then(|| self.0.split_off(self.0.len() - n as usize))
    }

    fn give_back(&mut self, blocks: Vec<BlockId>) {
        self.0.extend(blocks);
    }
}

fn pattern(id: u32, block: u32) -> Vec<u8> {
    let seed = (id.wrapping_mul(2_654_435_761) ^ block) as u8;
    (0..BLOCK_BYTES)
        .map(|i| seed.wrapping_add(i as u8))
        .collect()
}

/// Runs the demo, printing one line per lifecycle event, and reports.
pub async fn run(opts: &DemoOptions) -> Result<DemoReport, handoff_actors::Error> {
    let fabric = Fabric::new();
    let start = |role: Role, engine: &str| {
        let region = Region::new(POOL_BLOCKS, BLOCK_BYTES);
        let fabric = fabric.clone();
        let rank = RankInfo::single(engine);
        async move {
            Runtime::builder(role, rank)
                .mode(opts.mode)
                .transport(TransportChoice::InProcess(fabric))
                .region(Arc::new(region?))
                .start()
                .await
        }
    };
    let prefill = start(Role::Prefill, "prefill-0").await?;
    let decode = start(Role::Decode, "decode-0").await?;
    println!(
        "prefill-0 and decode-0 started on one in-process fabric ({:?} mode)",
        opts.mode
    );

    let (mut p_pool, mut d_pool) = (Pool::new(), Pool::new());
    let mut placed: BTreeMap<RequestId, Placement> = BTreeMap::new();
    let mut report = DemoReport::default();
    let (mut next, mut ended) = (0u32, 0u32);
    let t0 = Instant::now();
    while ended < opts.requests && t0.elapsed() < DEMO_DEADLINE {
        // Schedule: one new request per step while both pools have room.
        if next < opts.requests {
            if let (Some(src), Some(dst)) = (
                p_pool.take(opts.blocks_per_request),
                d_pool.take(opts.blocks_per_request),
            ) {
                let id = RequestId::new(format!("req-{next}"));
                let receiver = decode.receiver(
                    id.clone(),
                    ReceiverSpec {
                        prefill: EngineId::new("prefill-0"),
                        prefill_dp_rank: None,
                        blocks: Some(dst.clone()),
                    },
                )?;
                drop(receiver); // the demo follows requests through events alone
                for b in &src {
                    prefill.region().write_block(*b, &pattern(next, b.0))?;
                }
                let sender = prefill.sender(id.clone())?;
                sender.send(src.clone())?;
                placed.insert(id, Placement { n: next, src, dst });
                next += 1;
            }
        }
        tokio::time::sleep(STEP).await;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        for event in prefill.drain_events() {
            print_event(ms, "prefill-0", &event);
            if let Event::Released { blocks, .. } = event {
                p_pool.give_back(blocks);
            }
        }
        for event in decode.drain_events() {
            print_event(ms, "decode-0 ", &event);
            match event {
                Event::State {
                    id,
                    state: State::Done,
                    ..
                } => {
                    ended += 1;
                    report.done += 1;
                    if !placed.get(&id).is_some_and(|p| p.arrived_intact(&decode)) {
                        report.corrupted += 1;
                    }
                }
                Event::State {
                    id,
                    state: State::Failed(reason),
                    ..
                } => {
                    ended += 1;
                    report.failed.push((id, reason.to_string()));
                }
                // Decoding would start here; the demo frees the blocks at once.
                Event::Released { blocks, .. } => d_pool.give_back(blocks),
                Event::State { .. } => {}
            }
        }
    }
    prefill.shutdown().await;
    decode.shutdown().await;
    Ok(report)
}

/// Where one request's blocks were on each side.
struct Placement {
    n: u32,
    src: Vec<BlockId>,
    dst: Vec<BlockId>,
}

impl Placement {
    /// Decode's block k must hold what prefill wrote into its block k.
    fn arrived_intact(&self, decode: &Runtime) -> bool {
        self.src.iter().zip(&self.dst).all(|(s, d)| {
            decode
                .region()
                .read_block(*d)
                .is_ok_and(|bytes| bytes == pattern(self.n, s.0))
        })
    }
}

fn print_event(ms: f64, who: &str, event: &Event) {
    match event {
        Event::State { id, state, .. } => println!("{ms:9.3} ms  {who}  {id:<8} {state}"),
        Event::Released { id, blocks, why } => {
            println!(
                "{ms:9.3} ms  {who}  {id:<8} released {} blocks ({why})",
                blocks.len()
            )
        }
    }
}
