//! The TCP data transport between two processes: the test re-executes its own binary as a
//! child (env `HANDOFF_TCP_CHILD`) that serves a region under a grant table, prints its
//! address, and answers `checksum <ids>` / `fill <seed>` on stdin. The parent pushes and
//! pulls permuted blocks and compares checksums; a block not granted is refused and the
//! child goes on; a child killed mid-transfer fails the transfer promptly.

mod data_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use data_common::{
    checksum, fill, format_ids, ids, parse_ids, say, stdin_lines, ChildPeer, Rng, TableGrants,
};
use handoff_transport::data::{Access, DataError, RefusalCode};
use handoff_transport::tcp::{DataClient, DataServer, CLIENT_BUSY_POLL_DEFAULT};
use handoff_transport::{BlockId, RankInfo, Region, RequestId};

const CHILD_ENV: &str = "HANDOFF_TCP_CHILD";
const SLOW_ENV: &str = "HANDOFF_TCP_CHILD_SLOW_MS";
const PREFIX: &str = "TCP_CHILD ";
const BLOCKS: u32 = 256;
const BLOCK_BYTES: usize = 64 * 1024;
/// Deadline for any one step; generous for a loaded two-core CI machine.
const STEP: Duration = Duration::from_secs(30);
/// How long the child lives without its parent's commands.
const CHILD_LIFETIME: Duration = Duration::from_secs(120);

/// Not a test by itself: the child's entry point (a no-op unless `CHILD_ENV` is set).
#[test]
fn tcp_child_process_entry() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(child_main());
    std::process::exit(0);
}

async fn child_main() {
    let region = Arc::new(Region::new(BLOCKS, BLOCK_BYTES).unwrap());
    let grants = TableGrants::slow(
        std::env::var(SLOW_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis),
    );
    // r1 may write and read every block but the last eight; r2 has nothing.
    grants.grant("r1", Access::Write, 0..BLOCKS - 8);
    grants.grant("r1", Access::Read, 0..BLOCKS - 8);
    let server = DataServer::bind(
        "127.0.0.1:0",
        Arc::clone(&region),
        Arc::new(grants),
        RankInfo::single("decode-child"),
        None,
    )
    .await
    .unwrap();
    say(PREFIX, &format!("ready {}", server.local_addr()));
    let lines = stdin_lines();
    let stop_at = Instant::now() + CHILD_LIFETIME;
    while Instant::now() < stop_at {
        let line = match lines.try_recv() {
            Ok(line) => line,
            Err(std::sync::mpsc::TryRecvError::Empty) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
        };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["checksum", list] => say(
                PREFIX,
                &format!("checksum {}", checksum(&region, &parse_ids(list))),
            ),
            ["fill", seed] => {
                fill(&region, seed.parse().unwrap_or(0));
                say(PREFIX, "filled");
            }
            ["stats"] => say(PREFIX, &format!("stats {:?}", server.stats())),
            ["exit"] => return,
            _ => say(PREFIX, &format!("error unknown command {line:?}")),
        }
    }
}

fn spawn_child(slow_ms: Option<u64>) -> (ChildPeer, String) {
    let mut env = vec![(CHILD_ENV, "1".to_string())];
    if let Some(ms) = slow_ms {
        env.push((SLOW_ENV, ms.to_string()));
    }
    let mut child = ChildPeer::spawn("tcp_child_process_entry", &env, PREFIX);
    let ready = child.expect(STEP);
    let addr = ready
        .strip_prefix("ready ")
        .unwrap_or_else(|| panic!("child said {ready:?}"))
        .to_string();
    (child, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_push_and_pull_permuted_blocks_with_matching_checksums() {
    let (mut child, addr) = spawn_child(None);
    let c = DataClient::connect(&addr, RankInfo::single("prefill"), None, STEP)
        .await
        .unwrap();
    // A server in another process: each small operation's answer is met spinning.
    assert_eq!(c.busy_poll(), CLIENT_BUSY_POLL_DEFAULT);
    let local = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&local, 42);
    let r1 = RequestId::new("r1");
    let n = BLOCKS - 8;
    let src = ids(0..n);
    let dst: Vec<BlockId> = Rng::new(9).permutation(n);
    c.write(&r1, &local, &src, &dst, Instant::now() + STEP)
        .await
        .unwrap();
    let remote_sum = child.ask(&format!("checksum {}", format_ids(&dst)), STEP);
    assert_eq!(remote_sum, format!("checksum {}", checksum(&local, &src)));
    // One block at a time (operations small enough to spin for), written and read back.
    let one = ids(n - 16..n);
    let back = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    for (k, b) in one.iter().enumerate() {
        let at = [dst[k]];
        c.write(&r1, &local, &[*b], &at, Instant::now() + STEP)
            .await
            .unwrap();
        c.read(&r1, &back, &at, &[*b], Instant::now() + STEP)
            .await
            .unwrap();
    }
    assert_eq!(checksum(&back, &one), checksum(&local, &one));

    // Pull: the child fills its region; we read a permutation into ours.
    assert_eq!(child.ask("fill 77", STEP), "filled");
    let from = Rng::new(10).permutation(n);
    let into = ids(0..n);
    c.read(&r1, &local, &from, &into, Instant::now() + STEP)
        .await
        .unwrap();
    let remote_sum = child.ask(&format!("checksum {}", format_ids(&from)), STEP);
    assert_eq!(remote_sum, format!("checksum {}", checksum(&local, &into)));

    // A block the child did not grant is refused; the child goes on serving.
    let err = c
        .write(
            &r1,
            &local,
            &[BlockId(0)],
            &[BlockId(BLOCKS - 1)],
            Instant::now() + STEP,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, DataError::Refused { code: RefusalCode::NotGranted, ref peer, .. } if peer.contains("decode-child")),
        "{err}"
    );
    let err = c
        .read(
            &RequestId::new("r2"),
            &local,
            &[BlockId(0)],
            &[BlockId(0)],
            Instant::now() + STEP,
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
    // A block outside the child's region never leaves this process.
    let err = c
        .write(
            &r1,
            &local,
            &[BlockId(0)],
            &[BlockId(BLOCKS + 1)],
            Instant::now() + STEP,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, DataError::OutsidePeerRegion { .. }), "{err}");
    c.write(&r1, &local, &ids(0..4), &ids(4..8), Instant::now() + STEP)
        .await
        .unwrap();
    let remote_sum = child.ask(&format!("checksum {}", format_ids(&ids(4..8))), STEP);
    assert_eq!(
        remote_sum,
        format!("checksum {}", checksum(&local, &ids(0..4)))
    );
    let stats = child.ask("stats", STEP);
    assert!(stats.contains("refused: 2"), "{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_transfer_fails_the_transfer_promptly() {
    // 500 ms inside every granted copy: a 16 MiB write (four 4 MiB operations) is
    // certainly in flight when the child dies.
    let (mut child, addr) = spawn_child(Some(500));
    let c = DataClient::connect(&addr, RankInfo::single("prefill"), None, STEP)
        .await
        .unwrap();
    let local = Arc::new(Region::new(BLOCKS, BLOCK_BYTES).unwrap());
    let transfer = {
        let (c, local) = (c.clone(), Arc::clone(&local));
        tokio::spawn(async move {
            let blocks = ids(0..BLOCKS - 8);
            let result = c
                .write(
                    &RequestId::new("r1"),
                    &local,
                    &blocks,
                    &blocks,
                    Instant::now() + STEP,
                )
                .await;
            (result, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    child.kill();
    let killed = Instant::now();
    let (result, ended) = tokio::time::timeout(STEP, transfer)
        .await
        .expect("the transfer ends")
        .unwrap();
    let err = result.expect_err("a transfer to a killed peer fails");
    let after = ended.saturating_duration_since(killed);
    println!("transfer failed {after:?} after the kill: {err}");
    assert!(
        after < Duration::from_secs(3),
        "failed {after:?} after the kill: {err}"
    );
    assert!(
        matches!(err, DataError::PeerClosed { .. } | DataError::Io { .. }),
        "{err}"
    );
}
