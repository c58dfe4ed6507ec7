//! Two processes: the test re-executes its own binary as a child (env `HANDOFF_UCX_CHILD`)
//! that makes a worker and a region, prints its worker address, rkey (hex) and region
//! address, and serves `checksum`/`fill` commands on stdin while progressing its worker.
//! The parent puts a seeded pattern into a seeded permutation of blocks and gets one back;
//! a killed child must turn the next put/flush into an error within the deadline.
//! Skips with a printed reason when libucp cannot be loaded.

mod ucx_common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use handoff_transport::ucx::{
    Context, ContextOptions, Direction, Endpoint, MemoryRegion, MemoryType, RemoteKey, Segment,
    UcxError, Worker,
};
use ucx_common::{checksum, context_or_skip, hex, pattern, unhex, Rng};

const CHILD_ENV: &str = "HANDOFF_UCX_CHILD";
const CHILD_MEM_ENV: &str = "HANDOFF_UCX_CHILD_MEM";
const CHILD_BYTES_ENV: &str = "HANDOFF_UCX_CHILD_BYTES";
const PREFIX: &str = "UCX_CHILD ";
/// Deadline for any one step; generous for a loaded two-core CI machine.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the child lives without commands before it exits by itself.
const CHILD_LIFETIME: Duration = Duration::from_secs(120);

/// Options both sides use: the defaults (shared memory with peer-failure handling) with a
/// short keepalive, so a death the shared-memory transport cannot see is noticed quickly.
fn options() -> ContextOptions {
    ContextOptions {
        keepalive_interval: Some(Duration::from_millis(200)),
        ..ContextOptions::default()
    }
}

// ---------------------------------------------------------------- child side

/// Not a test by itself: the child process's entry point (a no-op unless `CHILD_ENV` is set).
#[test]
fn ucx_child_process_entry() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    if let Err(e) = child_main() {
        println!("{PREFIX}error {e}");
    }
    std::process::exit(0);
}

fn child_main() -> Result<(), UcxError> {
    let len: usize = std::env::var(CHILD_BYTES_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8 << 20);
    let ctx = Context::with_options(&options())?;
    let worker = Worker::new(&ctx)?;
    let region = match std::env::var(CHILD_MEM_ENV).as_deref() {
        Ok("heap") => MemoryRegion::register_owned(&ctx, vec![0u8; len].into_boxed_slice())?,
        _ => MemoryRegion::allocate(&ctx, len, MemoryType::Host)?,
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    say(&format!(
        "ready {} {} {} {}",
        hex(&worker.address()?),
        hex(&region.pack_rkey()?),
        region.address(),
        len
    ));
    let stop_at = Instant::now() + CHILD_LIFETIME;
    while Instant::now() < stop_at {
        worker.progress();
        let line = match rx.try_recv() {
            Ok(line) => line,
            Err(mpsc::TryRecvError::Empty) => continue,
            // Parent gone: do not linger.
            Err(mpsc::TryRecvError::Disconnected) => return Ok(()),
        };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["checksum"] => {
                let mut buf = vec![0u8; len];
                region.read(0, &mut buf)?;
                say(&format!("checksum {}", checksum(&buf)));
            }
            ["fill", seed] => {
                let seed = seed.parse().unwrap_or(0);
                region.write(0, &pattern(seed, len))?;
                say("filled");
            }
            ["exit"] => return Ok(()),
            _ => say(&format!("error unknown command {line:?}")),
        }
    }
    Ok(())
}

fn say(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{PREFIX}{text}");
    let _ = out.flush();
}

// ---------------------------------------------------------------- parent side

struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    address: Vec<u8>,
    rkey: Vec<u8>,
    base: u64,
    len: usize,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "exit");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Peer {
    fn spawn(mem: &str, len: usize) -> Peer {
        let exe = std::env::current_exe().expect("current exe");
        let mut child = Command::new(exe)
            .args([
                "--exact",
                "ucx_child_process_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .env(CHILD_MEM_ENV, mem)
            .env(CHILD_BYTES_ENV, len.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let stdin = child.stdin.take().expect("child stdin");
        let stdout = child.stdout.take().expect("child stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may print "test name ... " on the same line first.
                if let Some(at) = line.find(PREFIX) {
                    if tx.send(line[at + PREFIX.len()..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let ready = lines.recv_timeout(STEP_TIMEOUT).expect("child ready line");
        let words: Vec<&str> = ready.split_whitespace().collect();
        let ["ready", address, rkey, base, len] = words.as_slice() else {
            panic!("child said {ready:?}");
        };
        Peer {
            address: unhex(address).expect("address hex"),
            rkey: unhex(rkey).expect("rkey hex"),
            base: base.parse().expect("base"),
            len: len.parse().expect("len"),
            child,
            stdin,
            lines,
        }
    }

    /// Sends a command and waits for the reply while progressing `worker`.
    fn ask(&mut self, worker: &Worker, command: &str) -> String {
        writeln!(self.stdin, "{command}").expect("write command");
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            match self.lines.try_recv() {
                Ok(line) => return line,
                Err(mpsc::TryRecvError::Disconnected) => panic!("child exited"),
                Err(mpsc::TryRecvError::Empty) => {}
            }
            assert!(
                Instant::now() < deadline,
                "child did not answer {command:?}"
            );
            worker.progress();
        }
    }

    fn checksum(&mut self, worker: &Worker) -> u64 {
        let reply = self.ask(worker, "checksum");
        reply
            .strip_prefix("checksum ")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("child said {reply:?}"))
    }
}

struct Side {
    _ctx: Context,
    worker: Worker,
    local: MemoryRegion,
    ep: Endpoint,
    rkey: RemoteKey,
}

fn connect(ctx: Context, peer: &Peer, mem: &str) -> Side {
    let worker = Worker::new(&ctx).expect("worker");
    let local = if mem == "heap" {
        MemoryRegion::register_owned(&ctx, vec![0u8; peer.len].into_boxed_slice())
    } else {
        MemoryRegion::allocate(&ctx, peer.len, MemoryType::Host)
    }
    .expect("local region");
    let ep = worker.connect(&peer.address).expect("connect");
    let rkey = ep
        .unpack_rkey(&peer.rkey, peer.base, peer.len as u64)
        .expect("unpack rkey");
    Side {
        _ctx: ctx,
        worker,
        local,
        ep,
        rkey,
    }
}

/// Segments moving local block `i` to remote block `perm[i]`.
fn permuted(peer: &Peer, block: usize, seed: u64) -> (Vec<Segment>, Vec<usize>) {
    let blocks = peer.len / block;
    let perm = Rng::new(seed).permutation(blocks);
    let segs = (0..blocks)
        .map(|i| Segment {
            local_offset: i * block,
            remote_addr: peer.base + (perm[i] * block) as u64,
            len: block,
        })
        .collect();
    (segs, perm)
}

fn put_and_get_with_child(mem: &str) {
    let Some(ctx) = context_or_skip("ucx_two_process", &options()) else {
        return;
    };
    let block = 16 << 10;
    let mut peer = Peer::spawn(mem, 8 << 20);
    let side = connect(ctx, &peer, mem);

    // Put a seeded pattern into a seeded permutation of the child's blocks.
    let data = pattern(11, peer.len);
    side.local.write(0, &data).expect("write");
    let (segs, perm) = permuted(&peer, block, 12);
    let mut expected = vec![0u8; peer.len];
    for (i, &p) in perm.iter().enumerate() {
        expected[p * block..(p + 1) * block].copy_from_slice(&data[i * block..(i + 1) * block]);
    }
    let stats = side
        .ep
        .transfer(
            Direction::Put,
            &side.local,
            &side.rkey,
            &segs,
            Instant::now() + STEP_TIMEOUT,
        )
        .expect("put");
    assert_eq!(stats.bytes, peer.len as u64);
    assert_eq!(
        peer.checksum(&side.worker),
        checksum(&expected),
        "{mem}: put checksum"
    );

    // Get the child's pattern back through another permutation.
    assert_eq!(peer.ask(&side.worker, "fill 13"), "filled");
    let (segs, perm) = permuted(&peer, block, 14);
    side.ep
        .transfer(
            Direction::Get,
            &side.local,
            &side.rkey,
            &segs,
            Instant::now() + STEP_TIMEOUT,
        )
        .expect("get");
    let remote = pattern(13, peer.len);
    let mut got = vec![0u8; peer.len];
    side.local.read(0, &mut got).expect("read");
    for (i, &p) in perm.iter().enumerate() {
        assert_eq!(
            checksum(&got[i * block..(i + 1) * block]),
            checksum(&remote[p * block..(p + 1) * block]),
            "{mem}: get block {i}"
        );
    }
}

#[test]
fn ucx_put_get_with_child_process_allocated() {
    put_and_get_with_child("alloc");
}

#[test]
fn ucx_put_get_with_child_process_heap() {
    put_and_get_with_child("heap");
}

#[test]
fn ucx_killed_child_fails_within_deadline() {
    let Some(ctx) = context_or_skip("ucx_killed_child", &options()) else {
        return;
    };
    let mut peer = Peer::spawn("alloc", 1 << 20);
    let side = connect(ctx, &peer, "alloc");
    side.ep
        .put(
            &side.local,
            0,
            &side.rkey,
            peer.base,
            peer.len,
            Instant::now() + STEP_TIMEOUT,
        )
        .expect("put while alive");

    peer.child.kill().expect("kill child");
    peer.child.wait().expect("reap child");

    let deadline_each = Duration::from_secs(3);
    let give_up = Instant::now() + Duration::from_secs(20);
    let mut attempts = Vec::new();
    let error = loop {
        let started = Instant::now();
        let result = side.ep.put(
            &side.local,
            0,
            &side.rkey,
            peer.base,
            peer.len,
            started + deadline_each,
        );
        let took = started.elapsed();
        assert!(
            took < deadline_each + Duration::from_secs(2),
            "put to a dead peer took {took:?}, past its deadline"
        );
        attempts.push((took, result.is_ok()));
        if let Err(e) = result {
            break e;
        }
        assert!(
            Instant::now() < give_up,
            "dead peer never noticed: {attempts:?}"
        );
        side.worker
            .progress_until(Instant::now() + Duration::from_millis(50));
    };
    eprintln!(
        "dead peer noticed after {} attempts ({attempts:?}): {error}",
        attempts.len()
    );
    // Once failed, the endpoint stays closed and says why.
    let again = side
        .ep
        .put(
            &side.local,
            0,
            &side.rkey,
            peer.base,
            8,
            Instant::now() + deadline_each,
        )
        .expect_err("endpoint closed");
    assert!(matches!(again, UcxError::EndpointClosed { .. }), "{again}");
}
