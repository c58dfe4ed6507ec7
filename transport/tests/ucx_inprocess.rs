//! Two UCX workers (two contexts) in one process: the peer runs on its own thread (UCX
//! handles are single-thread), each side connects to the other, and puts and gets of a few
//! MiB between registered regions (heap-registered and UCX-allocated) are checked by
//! checksum. Skips with a printed reason when libucp cannot be loaded.

mod ucx_common;

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use handoff_transport::ucx::{
    ContextOptions, Direction, MemoryRegion, MemoryType, Segment, UcxError, Worker,
};
use ucx_common::{checksum, context_or_skip, pattern, Rng};

const REGION_BYTES: usize = 4 << 20;
const BLOCK_BYTES: usize = 64 << 10;
const DEADLINE: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug)]
enum Kind {
    Heap,
    Allocated,
}

fn region(ctx: &handoff_transport::ucx::Context, kind: Kind) -> MemoryRegion {
    match kind {
        Kind::Heap => MemoryRegion::register_owned(ctx, vec![0u8; REGION_BYTES].into_boxed_slice()),
        Kind::Allocated => MemoryRegion::allocate(ctx, REGION_BYTES, MemoryType::Host),
    }
    .expect("memory region")
}

/// What the peer thread publishes at start.
struct PeerInfo {
    address: Vec<u8>,
    rkey: Vec<u8>,
    base: u64,
}

enum Cmd {
    Checksum(mpsc::Sender<u64>),
    Fill(u64, mpsc::Sender<()>),
    /// Connect to the main worker and put `pattern(seed)` into its whole region.
    PutBack {
        address: Vec<u8>,
        rkey: Vec<u8>,
        base: u64,
        seed: u64,
        done: mpsc::Sender<Result<(), UcxError>>,
    },
    Stop,
}

fn peer(kind: Kind, info: mpsc::Sender<PeerInfo>, cmds: mpsc::Receiver<Cmd>) {
    let Some(ctx) = context_or_skip("peer", &ContextOptions::default()) else {
        return;
    };
    let worker = Worker::new(&ctx).expect("peer worker");
    let region = region(&ctx, kind);
    let _ = info.send(PeerInfo {
        address: worker.address().expect("address"),
        rkey: region.pack_rkey().expect("rkey"),
        base: region.address(),
    });
    let stop_at = Instant::now() + Duration::from_secs(120);
    while Instant::now() < stop_at {
        worker.progress();
        let cmd = match cmds.try_recv() {
            Ok(cmd) => cmd,
            Err(mpsc::TryRecvError::Empty) => continue,
            Err(mpsc::TryRecvError::Disconnected) => return,
        };
        match cmd {
            Cmd::Checksum(reply) => {
                let mut buf = vec![0u8; REGION_BYTES];
                region.read(0, &mut buf).expect("read");
                let _ = reply.send(checksum(&buf));
            }
            Cmd::Fill(seed, reply) => {
                region
                    .write(0, &pattern(seed, REGION_BYTES))
                    .expect("write");
                let _ = reply.send(());
            }
            Cmd::PutBack {
                address,
                rkey,
                base,
                seed,
                done,
            } => {
                let deadline = Instant::now() + DEADLINE;
                let result = (|| {
                    let ep = worker.connect(&address)?;
                    let key = ep.unpack_rkey(&rkey, base, REGION_BYTES as u64)?;
                    region.write(0, &pattern(seed, REGION_BYTES))?;
                    ep.put(&region, 0, &key, base, REGION_BYTES, deadline)
                })();
                let _ = done.send(result);
            }
            Cmd::Stop => return,
        }
    }
}

/// Waits for a reply while progressing our own worker (the peer may need us to answer
/// wireup or keepalive traffic).
fn await_reply<T>(worker: &Worker, rx: &mpsc::Receiver<T>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        match rx.try_recv() {
            Ok(v) => return v,
            Err(mpsc::TryRecvError::Disconnected) => panic!("peer thread ended"),
            Err(mpsc::TryRecvError::Empty) => {}
        }
        assert!(
            Instant::now() < deadline,
            "peer did not answer in {DEADLINE:?}"
        );
        worker.progress();
    }
}

fn put_get_between_threads(kind: Kind) {
    let Some(ctx) = context_or_skip("ucx_inprocess", &ContextOptions::default()) else {
        return;
    };
    let (info_tx, info_rx) = mpsc::channel();
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let peer_thread = thread::spawn(move || peer(kind, info_tx, cmd_rx));
    let info = info_rx.recv_timeout(DEADLINE).expect("peer info");

    let worker = Worker::new(&ctx).expect("worker");
    let local = region(&ctx, kind);
    let ep = worker.connect(&info.address).expect("connect");
    let rkey = ep
        .unpack_rkey(&info.rkey, info.base, REGION_BYTES as u64)
        .expect("unpack rkey");

    // Put: local block i goes to remote block perm[i].
    let data = pattern(1, REGION_BYTES);
    local.write(0, &data).expect("write local");
    let blocks = REGION_BYTES / BLOCK_BYTES;
    let perm = Rng::new(2).permutation(blocks);
    let segments: Vec<Segment> = (0..blocks)
        .map(|i| Segment {
            local_offset: i * BLOCK_BYTES,
            remote_addr: info.base + (perm[i] * BLOCK_BYTES) as u64,
            len: BLOCK_BYTES,
        })
        .collect();
    let mut expected = vec![0u8; REGION_BYTES];
    for (i, &p) in perm.iter().enumerate() {
        expected[p * BLOCK_BYTES..(p + 1) * BLOCK_BYTES]
            .copy_from_slice(&data[i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES]);
    }
    let deadline = Instant::now() + DEADLINE;
    let stats = ep
        .transfer(Direction::Put, &local, &rkey, &segments, deadline)
        .expect("put batch");
    assert_eq!(stats.bytes, REGION_BYTES as u64);
    let (tx, rx) = mpsc::channel();
    cmd_tx.send(Cmd::Checksum(tx)).expect("send");
    assert_eq!(
        await_reply(&worker, &rx),
        checksum(&expected),
        "{kind:?}: put checksum"
    );

    // Get: the peer fills its region; we read it whole, in one op.
    let (tx, rx) = mpsc::channel();
    cmd_tx.send(Cmd::Fill(3, tx)).expect("send");
    await_reply(&worker, &rx);
    ep.get(
        &local,
        0,
        &rkey,
        info.base,
        REGION_BYTES,
        Instant::now() + DEADLINE,
    )
    .expect("get");
    let mut got = vec![0u8; REGION_BYTES];
    local.read(0, &mut got).expect("read");
    assert_eq!(
        checksum(&got),
        checksum(&pattern(3, REGION_BYTES)),
        "{kind:?}: get checksum"
    );

    // The other direction: the peer connects to us and puts into our region.
    let (tx, rx) = mpsc::channel();
    cmd_tx
        .send(Cmd::PutBack {
            address: worker.address().expect("address"),
            rkey: local.pack_rkey().expect("rkey"),
            base: local.address(),
            seed: 4,
            done: tx,
        })
        .expect("send");
    await_reply(&worker, &rx).expect("peer put");
    local.read(0, &mut got).expect("read");
    assert_eq!(
        checksum(&got),
        checksum(&pattern(4, REGION_BYTES)),
        "{kind:?}: put back"
    );

    // Out-of-range descriptors are refused before anything is posted.
    let err = ep
        .put(
            &local,
            0,
            &rkey,
            info.base + 1,
            REGION_BYTES,
            Instant::now() + DEADLINE,
        )
        .expect_err("remote out of range");
    assert!(
        matches!(
            err,
            UcxError::OutOfRange {
                what: "remote region",
                ..
            }
        ),
        "{err}"
    );
    let err = ep
        .put(
            &local,
            1,
            &rkey,
            info.base,
            REGION_BYTES,
            Instant::now() + DEADLINE,
        )
        .expect_err("local out of range");
    assert!(
        matches!(
            err,
            UcxError::OutOfRange {
                what: "local region",
                ..
            }
        ),
        "{err}"
    );
    // ... and do not poison the endpoint.
    ep.flush(Instant::now() + DEADLINE)
        .expect("flush after refusals");

    // A deadline that has passed: the batch stops with `Timeout`, the endpoint is
    // force-closed (cancelling what was posted) and says so afterwards.
    let ep2 = worker.connect(&info.address).expect("second endpoint");
    let key2 = ep2
        .unpack_rkey(&info.rkey, info.base, REGION_BYTES as u64)
        .expect("unpack rkey");
    let err = ep2
        .transfer(Direction::Put, &local, &key2, &segments, Instant::now())
        .expect_err("deadline already passed");
    assert!(matches!(err, UcxError::Timeout { .. }), "{err}");
    let err = ep2
        .flush(Instant::now() + DEADLINE)
        .expect_err("closed endpoint");
    match err {
        UcxError::EndpointClosed { reason } => {
            assert!(matches!(*reason, UcxError::Timeout { .. }), "{reason}")
        }
        other => panic!("expected EndpointClosed, got {other}"),
    }
    // The key of a force-closed endpoint is refused, not used.
    let err = ep2
        .get(&local, 0, &key2, info.base, 8, Instant::now() + DEADLINE)
        .expect_err("closed endpoint");
    assert!(matches!(err, UcxError::EndpointClosed { .. }), "{err}");
    // The first endpoint is unaffected.
    ep.flush(Instant::now() + DEADLINE)
        .expect("other endpoint still fine");

    drop(key2);
    drop(ep2);
    drop(rkey);
    drop(ep);
    cmd_tx.send(Cmd::Stop).expect("stop");
    peer_thread.join().expect("peer thread");
}

#[test]
fn ucx_put_get_heap_registered_regions_in_process() {
    put_get_between_threads(Kind::Heap);
}

#[test]
fn ucx_put_get_allocated_regions_in_process() {
    put_get_between_threads(Kind::Allocated);
}

#[test]
fn ucx_missing_library_names_what_was_tried() {
    let err = handoff_transport::ucx::sys::load_from(Some(std::path::Path::new("/nonexistent")))
        .expect_err("no library at /nonexistent");
    match err {
        UcxError::LibraryNotFound { tried, .. } => {
            assert!(!tried.is_empty());
            assert!(
                tried.iter().all(|t| t.contains("/nonexistent")),
                "{tried:?}"
            );
        }
        other => panic!("expected LibraryNotFound, got {other}"),
    }
}

#[test]
fn ucx_coalesces_contiguous_runs_only() {
    use handoff_transport::ucx::coalesce;
    let s = |l, r, n| Segment {
        local_offset: l,
        remote_addr: r,
        len: n,
    };
    let merged = coalesce(&[
        s(0, 100, 10),
        s(10, 110, 5),
        s(15, 200, 5),
        s(20, 205, 5),
        s(0, 0, 1),
    ]);
    assert_eq!(merged, vec![s(0, 100, 15), s(15, 200, 10), s(0, 0, 1)]);
}

/// Env var telling a re-executed copy of this binary to check the env-driven loader.
const EXPECT_NOT_FOUND_ENV: &str = "HANDOFF_UCX_TEST_EXPECT_NOT_FOUND";

/// Child half of `ucx_env_pointing_nowhere_gives_library_not_found` (no-op otherwise).
#[test]
fn ucx_env_child_expect_not_found() {
    if std::env::var_os(EXPECT_NOT_FOUND_ENV).is_none() {
        return;
    }
    match handoff_transport::ucx::Context::new() {
        Err(UcxError::LibraryNotFound { tried, detail }) => {
            assert_eq!(tried, vec!["/nonexistent".to_string()], "{detail}");
            println!("LIBRARY_NOT_FOUND_AS_EXPECTED {tried:?}: {detail}");
        }
        other => panic!("expected LibraryNotFound, got {other:?}"),
    }
}

/// `HANDOFF_UCX_LIB=/nonexistent` through the cached, process-wide loader (in a fresh
/// process, since this one may have loaded the real library already).
#[test]
fn ucx_env_pointing_nowhere_gives_library_not_found() {
    let exe = std::env::current_exe().expect("current exe");
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            "ucx_env_child_expect_not_found",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(EXPECT_NOT_FOUND_ENV, "1")
        .env(handoff_transport::ucx::sys::LIB_ENV, "/nonexistent")
        .output()
        .expect("run child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}");
    assert!(stdout.contains("LIBRARY_NOT_FOUND_AS_EXPECTED"), "{stdout}");
}

/// Prints which libucp was loaded; with `HANDOFF_UCX_EXPECT_VERSION=1.22` set, checks it.
#[test]
fn ucx_reports_loaded_version() {
    let Some(ctx) = context_or_skip("ucx_reports_loaded_version", &ContextOptions::default())
    else {
        return;
    };
    let version = ctx.version();
    eprintln!("loaded UCX {version} from {}", ctx.library());
    assert!((version.major, version.minor) >= handoff_transport::ucx::sys::VERSION_MIN);
    if let Ok(expected) = std::env::var("HANDOFF_UCX_EXPECT_VERSION") {
        let found = format!("{}.{}", version.major, version.minor);
        assert_eq!(found, expected, "loaded {version} from {}", ctx.library());
    }
}

/// Where the UCX is old enough that peers' keys are vetted in a forked child (before 1.19),
/// registered host memory is not inherited by forks (`dc` in smaps), so the fork marks none of it
/// copy-on-write; the mark goes with the registration.
#[test]
fn registered_host_memory_is_kept_out_of_forks_while_registered() {
    let Some(ctx) = context_or_skip("dontfork", &ContextOptions::default()) else {
        return;
    };
    let buffer = vec![0u8; 8 << 20].into_boxed_slice();
    let probe = buffer.as_ptr() as usize + (4 << 20);
    let region = MemoryRegion::register_owned(&ctx, buffer).unwrap_or_else(|e| panic!("{e}"));
    let old_ucx = (ctx.version().major, ctx.version().minor) < (1, 19);
    let flags = handoff_testkit::vm_flags(probe);
    assert_eq!(flags.split(' ').any(|f| f == "dc"), old_ucx, "{flags}");
    drop(region);
    // The buffer went with the region: register again to see the mark undone.
    let mut again = vec![1u8; 8 << 20];
    let probe = again.as_mut_ptr() as usize + (4 << 20);
    // SAFETY: `again` outlives the region, which is dropped before it.
    let region =
        unsafe { MemoryRegion::register(&ctx, again.as_mut_ptr(), again.len(), MemoryType::Host) }
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        handoff_testkit::vm_flags(probe)
            .split(' ')
            .any(|f| f == "dc"),
        old_ucx
    );
    drop(region);
    let flags = handoff_testkit::vm_flags(probe);
    assert!(!flags.split(' ').any(|f| f == "dc"), "{flags}");
    drop(again);
}
