//! Helpers shared by the data-plane tests: a grant table, seeded patterns and
//! permutations, block checksums, and a child process driven over stdin/stdout.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use handoff_gpu::checksum::fill_pattern;
use handoff_gpu::Checksum64;
use handoff_transport::data::{Access, GrantError, Grants, UcxDataPlane, UcxPeer, UcxRange};
use handoff_transport::wire::{RegionDescriptor, TransportKind};
use handoff_transport::{BlockId, RankInfo, Region, RequestId};

/// Grants kept in a table: (request, access) → blocks; optionally slow inside the copy.
#[derive(Default)]
pub struct TableGrants {
    table: Mutex<HashMap<(RequestId, Access), HashSet<BlockId>>>,
    /// Sleep this long inside every granted copy (to keep a transfer in flight).
    pub slow: Option<Duration>,
}

impl TableGrants {
    /// An empty table whose copies take `slow` each.
    pub fn slow(slow: Option<Duration>) -> Self {
        Self {
            table: Mutex::default(),
            slow,
        }
    }

    pub fn grant(&self, request: &str, access: Access, blocks: impl IntoIterator<Item = u32>) {
        let mut table = self.table.lock().unwrap();
        table
            .entry((RequestId::new(request), access))
            .or_default()
            .extend(blocks.into_iter().map(BlockId));
    }
}

impl Grants for TableGrants {
    fn with_grant(
        &self,
        peer: &RankInfo,
        request: &RequestId,
        access: Access,
        blocks: &[BlockId],
        f: &mut dyn FnMut(),
    ) -> Result<(), GrantError> {
        let table = self.table.lock().unwrap();
        let granted = table.get(&(request.clone(), access));
        if let Some(b) = blocks
            .iter()
            .find(|b| !granted.is_some_and(|g| g.contains(b)))
        {
            return Err(GrantError::Block {
                request: request.clone(),
                block: *b,
                peer: peer.clone(),
            });
        }
        if let Some(slow) = self.slow {
            std::thread::sleep(slow);
        }
        f();
        Ok(())
    }
}

/// splitmix64, for seeded permutations.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A random permutation of `0..n` as block ids (Fisher-Yates).
    pub fn permutation(&mut self, n: u32) -> Vec<BlockId> {
        let mut p: Vec<BlockId> = (0..n).map(BlockId).collect();
        for i in (1..p.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            p.swap(i, j);
        }
        p
    }
}

/// Fills every block of `region` with the pattern of `seed` (block `b` at offset b × size).
pub fn fill(region: &Region, seed: u64) {
    let mut buf = vec![0u8; region.block_bytes()];
    for b in 0..region.blocks() {
        fill_pattern(&mut buf, seed, u64::from(b) * region.block_bytes() as u64);
        region.write_block(BlockId(b), &buf).unwrap();
    }
}

/// Checksum of the listed blocks, in order.
pub fn checksum(region: &Region, blocks: &[BlockId]) -> u64 {
    let mut sum = Checksum64::new();
    for b in blocks {
        sum.update(&region.read_block(*b).unwrap());
    }
    sum.finish()
}

pub fn ids(range: std::ops::Range<u32>) -> Vec<BlockId> {
    range.map(BlockId).collect()
}

pub fn parse_ids(text: &str) -> Vec<BlockId> {
    text.split(',')
        .filter(|t| !t.is_empty())
        .filter_map(|t| t.parse().ok())
        .map(BlockId)
        .collect()
}

pub fn format_ids(blocks: &[BlockId]) -> String {
    blocks
        .iter()
        .map(|b| b.0.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// A child process (this test binary re-executed with an env var) that prints lines
/// prefixed with `prefix` and takes commands on stdin.
pub struct ChildPeer {
    pub child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    prefix: &'static str,
}

impl ChildPeer {
    pub fn spawn(test: &str, env: &[(&str, String)], prefix: &'static str) -> ChildPeer {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new(exe);
        cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may print "test name ... " before the child's first line.
                if let Some(at) = line.find(prefix) {
                    if tx.send(line[at + prefix.len()..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        ChildPeer {
            child,
            stdin,
            lines,
            prefix,
        }
    }

    pub fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The next line from the child, within `timeout`.
    pub fn expect(&mut self, timeout: Duration) -> String {
        self.lines
            .recv_timeout(timeout)
            .unwrap_or_else(|e| panic!("child said nothing within {timeout:?}: {e}"))
    }

    pub fn ask(&mut self, line: &str, timeout: Duration) -> String {
        self.send(line);
        self.expect(timeout)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildPeer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "exit");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
    }
}

/// Prints a line for the parent.
pub fn say(prefix: &str, text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{prefix}{text}");
    let _ = out.flush();
}

/// Reads stdin lines on a thread; the receiver disconnects when the parent goes away.
pub fn stdin_lines() -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A child's command loop over `region`, until `exit`, stdin closing, or `lifetime`:
/// `checksum <blocks>` answers the blocks' checksum, `fill <seed>` fills the region.
/// Every answer is a line prefixed with `prefix`. Exits the process at the end.
pub fn serve_commands(prefix: &str, region: &Region, lifetime: Duration) -> ! {
    let lines = stdin_lines();
    let stop_at = Instant::now() + lifetime;
    while Instant::now() < stop_at {
        let line = match lines.recv_timeout(Duration::from_millis(50)) {
            Ok(line) => line,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["checksum", list] => say(
                prefix,
                &format!("checksum {}", checksum(region, &parse_ids(list))),
            ),
            ["fill", seed] => {
                fill(region, seed.parse().unwrap_or(0));
                say(prefix, "filled");
            }
            ["exit"] => break,
            _ => say(prefix, &format!("error unknown command {line:?}")),
        }
    }
    std::process::exit(0);
}

/// The `ready <worker address> <rkey> <base> <len>` line a UCX child prints, as a peer
/// named `name` with blocks of `block_bytes`.
pub fn parse_ready(ready: &str, name: &str, block_bytes: usize) -> UcxPeer {
    let words: Vec<&str> = ready.split_whitespace().collect();
    let ["ready", address, rkey, base, len] = words.as_slice() else {
        panic!("child said {ready:?}");
    };
    UcxPeer::one_range(
        name.into(),
        unhex(address).unwrap(),
        RegionDescriptor {
            transport: TransportKind::Ucx,
            address: name.into(),
            remote_key: unhex(rkey).unwrap(),
            base: base.parse().unwrap(),
            len: len.parse().unwrap(),
            block_bytes: block_bytes as u64,
        },
    )
}

/// The `ready <worker address> <blocks> <block bytes> <range>...` line a UCX child prints
/// for a plane of any layout, each range `<rkey>:<addr>:<len>:<stride>:<bytes>:<cuda ipc>`
/// (hex, empty for none).
pub fn layout_ready_line(plane: &UcxDataPlane) -> String {
    let d = plane.descriptor();
    let region = plane.region();
    let mut line = format!(
        "ready {} {} {}",
        hex(&d.worker_address),
        region.blocks(),
        region.block_bytes()
    );
    for r in d.range_list() {
        line += &format!(
            " {}:{}:{}:{}:{}:{}",
            hex(&r.remote_key),
            r.addr,
            r.len,
            r.stride,
            r.bytes,
            hex(&r.cuda_ipc)
        );
    }
    line
}

/// The peer a [`layout_ready_line`] describes, named `name`.
pub fn parse_layout_ready(ready: &str, name: &str) -> UcxPeer {
    let words: Vec<&str> = ready.split_whitespace().collect();
    let ["ready", address, blocks, block_bytes, ranges @ ..] = words.as_slice() else {
        panic!("child said {ready:?}");
    };
    let blocks: u64 = blocks.parse().unwrap();
    let block_bytes: u64 = block_bytes.parse().unwrap();
    let ranges: Vec<UcxRange> = ranges
        .iter()
        .map(|r| {
            let f: Vec<&str> = r.split(':').collect();
            UcxRange {
                remote_key: unhex(f[0]).unwrap(),
                addr: f[1].parse().unwrap(),
                len: f[2].parse().unwrap(),
                stride: f[3].parse().unwrap(),
                bytes: f[4].parse().unwrap(),
                cuda_ipc: f.get(5).map_or(Vec::new(), |h| unhex(h).unwrap()),
            }
        })
        .collect();
    UcxPeer {
        name: name.into(),
        worker_address: unhex(address).unwrap(),
        region: RegionDescriptor {
            transport: TransportKind::Ucx,
            address: name.into(),
            remote_key: Vec::new(),
            base: 0,
            len: blocks * block_bytes,
            block_bytes,
        },
        ranges: ranges.into(),
        process: None,
        device: None,
    }
}

/// A TCP data server on a loopback port, as rank `decode`, over a fresh region of `blocks`
/// blocks of `block_bytes`.
pub async fn tcp_server(
    blocks: u32,
    block_bytes: usize,
    grants: std::sync::Arc<dyn Grants>,
    key: Option<handoff_transport::auth::Key>,
    config: handoff_transport::tcp::ServerConfig,
) -> (handoff_transport::tcp::DataServer, std::sync::Arc<Region>) {
    let region = std::sync::Arc::new(Region::new(blocks, block_bytes).unwrap());
    let server = handoff_transport::tcp::DataServer::bind_with(
        "127.0.0.1:0",
        std::sync::Arc::clone(&region),
        grants,
        RankInfo::single("decode"),
        key,
        config,
    )
    .await
    .unwrap();
    (server, region)
}
