//! The floor under the scale run: the actors' plumbing alone, without their logic.
//!
//! `cargo run --release -p handoff-sim --example plumbing [-- WORKERS [REQUESTS [PER_MS]]]`
//! (defaults 1,000 workers, 300,000 requests, 20 opened per virtual millisecond, about the
//! scale run's last step).
//!
//! Each worker is a root task reading an unbounded mailbox, as the runtime's root is. A
//! request opens on two random workers; each root spawns a task for it with a mailbox of its
//! own, forwards it three messages over the next 11 virtual ms, and aborts it when it reports
//! its end, as the runtime's root retires a request actor. That is the scale run's
//! per-request traffic (8 root messages, 6 actor messages, 2 tasks, 2 mailboxes, a deadline
//! re-armed per message), with messages the size of the runtime's (176 bytes) and a request's
//! state 512 bytes, on the same tokio in paused time and the same allocator. What it does
//! not do is everything the runtime and the simulator decide per message: the difference
//! between its µs per request and the scale run's is that work.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio::sync::mpsc;

#[path = "shared/alloc.rs"]
mod alloc;

#[global_allocator]
static ALLOC: alloc::Mimalloc = alloc::Mimalloc;

/// 176 bytes, as the runtime's `RootMsg` and `RequestMsg`.
type Payload = [u64; 20];

enum RootMsg {
    Open(u64),
    Forward(u64, Payload),
    Ended(u64),
}

async fn request(
    id: u64,
    root: mpsc::UnboundedSender<RootMsg>,
    mut rx: mpsc::UnboundedReceiver<Payload>,
) {
    let mut state = [0u64; 64];
    let mut seen = 0usize;
    let deadline = tokio::time::sleep(Duration::from_secs(3600));
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            biased;
            msg = rx.recv() => match msg {
                Some(payload) => {
                    state[seen % state.len()] ^= payload[0];
                    seen += 1;
                }
                None => return,
            },
            () = &mut deadline => return,
        }
        let next = tokio::time::Instant::now() + Duration::from_millis(50 + seen as u64);
        deadline.as_mut().reset(next);
        if seen == 3 {
            std::hint::black_box(&state);
            let _ = root.send(RootMsg::Ended(id));
        }
    }
}

async fn root(me: mpsc::UnboundedSender<RootMsg>, mut rx: mpsc::UnboundedReceiver<RootMsg>) {
    let mut live = HashMap::new();
    while let Some(msg) = rx.recv().await {
        match msg {
            RootMsg::Open(id) => {
                let (tx, mailbox) = mpsc::unbounded_channel();
                let task = tokio::spawn(Box::pin(request(id, me.clone(), mailbox)));
                live.insert(id, (tx, task.abort_handle()));
            }
            RootMsg::Forward(id, payload) => {
                if let Some((tx, _)) = live.get(&id) {
                    let _ = tx.send(payload);
                }
            }
            RootMsg::Ended(id) => {
                if let Some((_, task)) = live.remove(&id) {
                    task.abort();
                }
            }
        }
    }
}

fn main() {
    if !alloc::keep_freed_memory() {
        eprintln!(
            "plumbing: mimalloc's purge delay is not where this build expects it; left as is"
        );
    }
    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>().ok());
    let workers = args.next().flatten().unwrap_or(1_000).max(1);
    let requests = args.next().flatten().unwrap_or(300_000);
    let per_ms = args.next().flatten().unwrap_or(20).max(1);
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return eprintln!("plumbing: no runtime: {e}"),
    };
    let started = std::time::Instant::now();
    rt.block_on(async move {
        let roots: Vec<_> = (0..workers)
            .map(|_| {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(root(tx.clone(), rx));
                tx
            })
            .collect();
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut pick = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % workers) as usize
        };
        let mut agenda: BTreeMap<u64, Vec<(usize, RootMsg)>> = BTreeMap::new();
        let (mut opened, mut t) = (0u64, 0u64);
        while opened < requests || !agenda.is_empty() {
            for _ in 0..per_ms.min(requests - opened) {
                let (p, d, a, b) = (pick(), pick(), opened * 2, opened * 2 + 1);
                for (at, what) in [(0, 0), (2, 1), (6, 2), (11, 3)] {
                    let slot = agenda.entry(t + at).or_default();
                    for (worker, id) in [(p, a), (d, b)] {
                        let msg = match what {
                            0 => RootMsg::Open(id),
                            n => RootMsg::Forward(id, [n; 20]),
                        };
                        slot.push((worker, msg));
                    }
                }
                opened += 1;
            }
            for (worker, msg) in agenda.remove(&t).unwrap_or_default() {
                let _ = roots[worker].send(msg);
            }
            t += 1;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    });
    let wall = started.elapsed().as_secs_f64();
    println!(
        "workers {workers} requests {requests} wall_s {wall:.2} us_per_request {:.1}",
        wall * 1e6 / requests.max(1) as f64
    );
}
