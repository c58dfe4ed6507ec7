//! Put throughput between two processes over our UCX bindings.
//!
//! `cargo run --release -p handoff-transport --example ucx_bench [total_mib]`
//!
//! Re-executes itself as the target process (`serve <alloc|heap> <bytes>`), which makes a
//! worker and a region and progresses it; the client puts blocks of 16 KiB, 1 MiB and
//! 4 MiB into it (remote order reversed so no two blocks coalesce: one UCX op per block),
//! flushes, and reports GB/s for UCX-allocated and heap-registered memory on both sides.
//! UCX configuration comes from `UCX_*` environment variables as usual.

#[path = "../tests/ucx_common/mod.rs"]
mod ucx_common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use handoff_transport::ucx::{
    Context, ContextOptions, Direction, MemoryRegion, MemoryType, Segment, UcxError, Worker,
};
use ucx_common::{hex, unhex};

/// Size of the region on each side; every block size walks it end to end.
const REGION_BYTES: usize = 128 << 20;
const BLOCK_SIZES: [usize; 3] = [16 << 10, 1 << 20, 4 << 20];
const DEADLINE: Duration = Duration::from_secs(120);

fn region(ctx: &Context, mem: &str, len: usize) -> Result<MemoryRegion, UcxError> {
    if mem == "heap" {
        MemoryRegion::register_owned(ctx, vec![1u8; len].into_boxed_slice())
    } else {
        let r = MemoryRegion::allocate(ctx, len, MemoryType::Host)?;
        r.write(0, &vec![1u8; len])?; // fault the pages in, as the heap case does
        Ok(r)
    }
}

fn serve(mem: &str, len: usize) -> Result<(), UcxError> {
    let ctx = Context::with_options(&options())?;
    let worker = Worker::new(&ctx)?;
    let region = region(&ctx, mem, len)?;
    println!(
        "ready {} {} {}",
        hex(&worker.address()?),
        hex(&region.pack_rkey()?),
        region.address()
    );
    std::io::stdout().flush().ok();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        let _ = tx.send(());
    });
    let stop = Instant::now() + Duration::from_secs(600);
    while Instant::now() < stop && rx.try_recv().is_err() {
        for _ in 0..1024 {
            worker.progress();
        }
    }
    Ok(())
}

fn bench(mem: &str, total_bytes: usize) -> Result<(), Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args(["serve", mem, &REGION_BYTES.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let mut line = String::new();
    stdout.read_line(&mut line)?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let ["ready", addr, rkey, base] = words.as_slice() else {
        return Err(format!("server said {line:?}").into());
    };
    let (addr, rkey) = (unhex(addr).ok_or("hex")?, unhex(rkey).ok_or("hex")?);
    let base: u64 = base.parse()?;

    let ctx = Context::with_options(&options())?;
    let worker = Worker::new(&ctx)?;
    let local = region(&ctx, mem, REGION_BYTES)?;
    let ep = worker.connect(&addr)?;
    let key = ep.unpack_rkey(&rkey, base, REGION_BYTES as u64)?;
    for block in BLOCK_SIZES {
        let blocks = REGION_BYTES / block;
        // `hot`: the same block over and over, as ucx_perftest does (cache-resident for
        // small blocks); otherwise walk the whole region (memory-bandwidth bound).
        let hot = std::env::var_os("HANDOFF_UCX_BENCH_HOT").is_some();
        let segs: Vec<Segment> = (0..blocks)
            .map(|i| Segment {
                local_offset: if hot { 0 } else { i * block },
                remote_addr: base
                    + if hot {
                        0
                    } else {
                        ((blocks - 1 - i) * block) as u64
                    },
                len: block,
            })
            .collect();
        // Warm-up pass (wireup, registration caches, page faults).
        ep.transfer(
            Direction::Put,
            &local,
            &key,
            &segs,
            Instant::now() + DEADLINE,
        )?;
        let rounds = (total_bytes / REGION_BYTES).max(1);
        let started = Instant::now();
        let mut ops = 0;
        for _ in 0..rounds {
            let stats = ep.transfer(
                Direction::Put,
                &local,
                &key,
                &segs,
                Instant::now() + DEADLINE,
            )?;
            ops += stats.ops;
        }
        let secs = started.elapsed().as_secs_f64();
        let bytes = (rounds * REGION_BYTES) as f64;
        println!(
            "{mem:>5} {:>5} KiB blocks: {:>7.2} GB/s ({:>6} ops, {:.3} s, {:.1} us/op)",
            block >> 10,
            bytes / secs / 1e9,
            ops,
            secs,
            secs * 1e6 / ops as f64
        );
    }
    drop(key);
    drop(ep);
    if let Some(mut stdin) = child.stdin.take() {
        let _ = writeln!(stdin, "exit");
    }
    let _ = child.wait();
    Ok(())
}

/// `HANDOFF_UCX_BENCH_CONFIG="MM_ERROR_HANDLING=n"` passes config
/// through `ContextOptions` (as the runtime would) rather than the environment.
fn options() -> ContextOptions {
    let config = std::env::var("HANDOFF_UCX_BENCH_CONFIG").unwrap_or_default();
    ContextOptions {
        config: config
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..ContextOptions::default()
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        let mem = args.get(2).map_or("alloc", String::as_str);
        let len = args
            .get(3)
            .and_then(|v| v.parse().ok())
            .unwrap_or(REGION_BYTES);
        serve(mem, len)?;
        return Ok(());
    }
    let total_mib: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(2048);
    let ctx = Context::new()?;
    println!("UCX {} from {}", ctx.version(), ctx.library());
    drop(ctx);
    let mems = std::env::var("HANDOFF_UCX_BENCH_MEM").unwrap_or_else(|_| "alloc,heap".into());
    for mem in mems.split(',') {
        bench(mem, total_mib << 20)?;
    }
    Ok(())
}
