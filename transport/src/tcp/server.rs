//! [`DataServer`]: serves one region to peers, checking every operation against the
//! runtime's grants.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::timeout;

use super::frame::{self, FrameError, Header, HelloOk, Op, Segment, HEADER_BYTES, NONCE_BYTES};
use super::io::{
    busy_poll, io_error, read_head, session, set_low_water, try_recv_raw, write_frame,
    write_frame_raw, RawSlice, RECV_LOW_WATER_MAX,
};
use super::{
    CONNECTION_IDLE_TIMEOUT_DEFAULT, FRAME_READ_TIMEOUT_DEFAULT, OP_BYTES_MAX,
    SERVER_CONNECTIONS_MAX, SERVER_PENDING_PER_SOURCE_MAX,
};
use crate::admission::{admission, Bound, Limits};
use crate::auth::Key;
use crate::data::{plan, Access, DataError, Grants, RefusalCode};
use crate::noise::{Opener, Sealer};
use crate::region::Region;
use crate::types::{BlockId, RankInfo, RequestId};

/// The buffer a refused operation's data is read through and dropped.
const DISCARD_CHUNK_BYTES: usize = 16 << 10;

/// Most bytes one receive of a write lands in the blocks, under their grant: bounds how
/// long a revocation waits for a receive in flight (a copy of 1 MiB: well under a
/// millisecond) and how many blocks each receive's grant check names.
const RECV_CHUNK_BYTES: usize = 1 << 20;

/// How long the server tries to deliver an `Error` frame to a peer it is about to drop.
const ERROR_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// A server's time limits and connection bound. [`Default`] gives the named defaults.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Time to receive the rest of a frame once its header arrived, and the `Hello`.
    pub frame_read_timeout: Duration,
    /// A connection with no frame for this long is closed.
    pub idle_timeout: Duration,
    /// Connections served at once; a further one gets `Busy` and is closed.
    pub connections_max: usize,
    /// Connections from one address that have not said hello, at most (the oldest of the
    /// address is evicted for a newcomer from it).
    pub pending_per_source_max: usize,
    /// After answering, wait for the connection's next frame spinning this long (at most
    /// [`BUSY_POLL_MAX`](super::BUSY_POLL_MAX)) before sleeping: lower latency for the
    /// price of CPU. Zero (the default): sleep at once.
    pub busy_poll: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            frame_read_timeout: FRAME_READ_TIMEOUT_DEFAULT,
            idle_timeout: CONNECTION_IDLE_TIMEOUT_DEFAULT,
            connections_max: SERVER_CONNECTIONS_MAX,
            pending_per_source_max: SERVER_PENDING_PER_SOURCE_MAX,
            busy_poll: Duration::ZERO,
        }
    }
}

/// What a server has done since it started (for tests, metrics and logs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Write operations completed.
    pub writes: u64,
    /// Read operations completed.
    pub reads: u64,
    /// Operations refused (not granted, out of range, malformed metadata).
    pub refused: u64,
    /// Connections closed for a protocol or authentication error.
    pub dropped_connections: u64,
    /// Connections accepted (including ones answered `Busy`), each counted once the server
    /// has decided on it: a snapshot that counts a connection holds the evictions it caused.
    pub connections: u64,
    /// Connections that had not said hello, evicted at the connection limit for a newcomer.
    pub evicted: u64,
    /// Of those, evicted because their address had too many pending.
    pub evicted_per_source: u64,
}

#[derive(Default)]
struct Counters {
    writes: AtomicU64,
    reads: AtomicU64,
    refused: AtomicU64,
    dropped: AtomicU64,
    connections: AtomicU64,
    open: AtomicUsize,
    evicted: AtomicU64,
    evicted_per_source: AtomicU64,
}

struct Shared {
    region: Arc<Region>,
    grants: Arc<dyn Grants>,
    me: RankInfo,
    key: Option<Key>,
    config: ServerConfig,
    counters: Counters,
    /// Mixed into every connection's nonce so nonces differ across servers and restarts.
    nonce_seed: u64,
    next_connection: AtomicU64,
}

/// A TCP data server: serves one region (the worker's KV pool) to peers.
///
/// Made by the runtime's network link, once per worker, with [`DataServer::bind`] (inside
/// a tokio runtime); its [`DataServer::local_addr`] goes into the worker's bootstrap record.
/// It accepts connections on its own task, one task per connection. Dropping it stops
/// accepting and closes every connection; a copy into the region never stops half-way
/// (copies run between await points, inside the grant).
pub struct DataServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for DataServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataServer")
            .field("local_addr", &self.local_addr)
            .field("me", &self.shared.me)
            .finish_non_exhaustive()
    }
}

impl Drop for DataServer {
    fn drop(&mut self) {
        // Aborting the accept task drops its JoinSet, which aborts every connection task.
        self.task.abort();
        let mut ports = listening_here();
        if let Some(n) = ports.get_mut(&self.local_addr.port()) {
            *n -= 1;
            if *n == 0 {
                ports.remove(&self.local_addr.port());
            }
        }
    }
}

/// The ports this process's data servers listen on, each with how many servers.
fn listening_here() -> std::sync::MutexGuard<'static, BTreeMap<u16, usize>> {
    static PORTS: Mutex<BTreeMap<u16, usize>> = Mutex::new(BTreeMap::new());
    PORTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether a connection from `local` to `peer` reaches a data server of this process: the
/// same host (a connection to this host leaves from the address it reaches) and a port one
/// of this process's servers listens on. Such a server is served by the same runtime's
/// workers as its client, so a client spinning for its answer would hold one of them.
pub(super) fn served_by_this_process(local: SocketAddr, peer: SocketAddr) -> bool {
    local.ip() == peer.ip() && listening_here().contains_key(&peer.port())
}

impl DataServer {
    /// Listens on `addr` (e.g. `127.0.0.1:0`) and serves `region` under `grants`, with
    /// [`ServerConfig::default`]. `key`: peers must authenticate every frame with it.
    pub async fn bind(
        addr: &str,
        region: Arc<Region>,
        grants: Arc<dyn Grants>,
        me: RankInfo,
        key: Option<Key>,
    ) -> Result<DataServer, DataError> {
        Self::bind_with(addr, region, grants, me, key, ServerConfig::default()).await
    }

    /// [`DataServer::bind`] with explicit limits.
    pub async fn bind_with(
        addr: &str,
        region: Arc<Region>,
        grants: Arc<dyn Grants>,
        me: RankInfo,
        key: Option<Key>,
        config: ServerConfig,
    ) -> Result<DataServer, DataError> {
        let bind_error = |detail: String| DataError::Bind {
            addr: addr.to_string(),
            detail,
        };
        // The server copies through the CPU: device memory is served over UCX.
        region.check_host("the TCP data server")?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| bind_error(e.to_string()))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| bind_error(e.to_string()))?;
        let shared = Arc::new(Shared {
            region,
            grants,
            me,
            key,
            config,
            counters: Counters::default(),
            nonce_seed: nonce_seed(),
            next_connection: AtomicU64::new(0),
        });
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        *listening_here().entry(local_addr.port()).or_default() += 1;
        tracing::debug!(%local_addr, me = %shared.me, "data server listening");
        Ok(DataServer {
            local_addr,
            shared,
            task,
        })
    }

    /// The address the server listens on (with the port the system chose for `:0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Counters since the server started.
    pub fn stats(&self) -> ServerStats {
        let c = &self.shared.counters;
        // Read first, paired with the accept loop's release: every admission decision for
        // the connections counted here (evictions) is in the counters read after it.
        let connections = c.connections.load(Ordering::Acquire);
        ServerStats {
            writes: c.writes.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            dropped_connections: c.dropped.load(Ordering::Relaxed),
            connections,
            evicted: c.evicted.load(Ordering::Relaxed),
            evicted_per_source: c.evicted_per_source.load(Ordering::Relaxed),
        }
    }
}

/// A seed that differs per process and per server: the std hasher's random keys and the
/// clock. Nonces must be unique, not secret.
fn nonce_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Counts a connection open while it lives (also when its task is aborted), once: an
/// evicted connection is uncounted at once ([`OpenGuard::release`]), not when its aborted
/// task is dropped later, so the next newcomer sees the place free.
struct OpenGuard {
    shared: Arc<Shared>,
    counted: Arc<AtomicBool>,
}

impl OpenGuard {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.counters.open.fetch_add(1, Ordering::AcqRel);
        Self {
            shared: Arc::clone(shared),
            counted: Arc::new(AtomicBool::new(true)),
        }
    }

    fn release(counted: &AtomicBool, shared: &Shared) {
        if counted.swap(false, Ordering::AcqRel) {
            shared.counters.open.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        Self::release(&self.counted, &self.shared);
    }
}

/// A connection that has not said hello yet: its task, whether it said hello since, its
/// address, and its place in the open count.
struct Pending {
    task: tokio::task::AbortHandle,
    hello: Arc<AtomicBool>,
    source: IpAddr,
    counted: Arc<AtomicBool>,
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    // Connections that have not said hello yet, oldest first, with their address: at a
    // bound the oldest (of the newcomer's address, at the per-source bound) is evicted, so
    // strangers that connect and say nothing cannot lock out a peer's new connection
    // (peers' established connections are never evicted; see `crate::admission`).
    let mut pending: BTreeMap<u64, Pending> = BTreeMap::new();
    let limits = Limits {
        total: shared.config.connections_max,
        pending: shared.config.connections_max,
        per_source: shared.config.pending_per_source_max,
    };
    let mut next = 0u64;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, addr)) => {
                    pending.retain(|_, p| !p.task.is_finished() && !p.hello.load(Ordering::Acquire));
                    let open = shared.counters.open.load(Ordering::Acquire);
                    let waiting = pending.iter().map(|(k, p)| (*k, p.source));
                    match admission(open, waiting, addr.ip(), &limits) {
                        Ok(None) => {}
                        Ok(Some((bound, evicted))) => {
                            if let Some(p) = pending.remove(&evicted) {
                                p.task.abort();
                                OpenGuard::release(&p.counted, &shared);
                            }
                            shared.counters.evicted.fetch_add(1, Ordering::Relaxed);
                            if bound == Bound::Source {
                                shared.counters.evicted_per_source.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(peer = %addr, max = limits.per_source, "data server: too many connections from this address have not said hello; evicted its oldest");
                            } else {
                                tracing::warn!(peer = %addr, max = limits.total, "data server at its connection limit; evicted the oldest connection that had not said hello");
                            }
                        }
                        Err(_) => {
                            tracing::warn!(peer = %addr, max = limits.total, "data server at its connection limit; refusing");
                            shared.counters.connections.fetch_add(1, Ordering::Release);
                            connections.spawn(async move {
                                refuse_connection(stream, RefusalCode::Busy, "server at its connection limit").await;
                            });
                            continue;
                        }
                    }
                    // Counted once its admission is decided and recorded (see `stats`).
                    shared.counters.connections.fetch_add(1, Ordering::Release);
                    let guard = OpenGuard::new(&shared);
                    let counted = Arc::clone(&guard.counted);
                    let hello = Arc::new(AtomicBool::new(false));
                    let said = hello.clone();
                    let task = connections.spawn(async move {
                        let open = guard;
                        serve_connection(stream, addr, &open.shared, &said).await;
                    });
                    next += 1;
                    pending.insert(next, Pending { task, hello, source: addr.ip(), counted });
                }
                Err(e) => {
                    // Out of file descriptors and the like: wait a little rather than spin.
                    tracing::warn!(error = %e, "data server accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn refuse_connection(stream: TcpStream, code: RefusalCode, detail: &str) {
    let (_r, mut w) = stream.into_split();
    let header = Header {
        op: Op::Error,
        flags: 0,
        seq: 0,
        meta_len: 0,
        data_len: 0,
    };
    let meta = frame::encode_error(code.to_wire(), detail);
    let _ = timeout(
        ERROR_SEND_TIMEOUT,
        write_frame(&mut w, header, &meta, &[], None),
    )
    .await;
}

/// One connection's state: its halves, nonce, the peer's name and reusable buffers.
struct Conn<'a> {
    shared: &'a Shared,
    r: OwnedReadHalf,
    w: OwnedWriteHalf,
    nonce: [u8; NONCE_BYTES],
    /// With a shared secret: this connection's Noise session, one half per direction.
    sealer: Option<Sealer>,
    opener: Option<Opener>,
    /// `engine/rank@address` once the peer said hello, its address before.
    peer: String,
    rank: Option<RankInfo>,
    meta: Vec<u8>,
    segments: Vec<Segment>,
    blocks: Vec<BlockId>,
    /// A write's chunk being received: its pieces of the region, their addresses, and the
    /// blocks it touches (reused buffers).
    pieces: Vec<crate::layout::Segment>,
    dst: Vec<RawSlice>,
    chunk_blocks: Vec<BlockId>,
    /// The socket's receive low-water mark now: raised while a write's data is due
    /// ([`RECV_LOW_WATER_MAX`] at most), 1 (the kernel's default) whenever a frame is.
    low_water: usize,
}

/// How a write's data went into its blocks.
enum Landed {
    /// Every byte landed.
    All,
    /// Stopped after `taken` bytes (its grant ended, or the region refused a range): the
    /// rest is still in the socket, and the write is refused.
    Stopped {
        taken: usize,
        code: RefusalCode,
        why: String,
    },
}

impl Landed {
    fn internal(taken: usize, e: impl std::fmt::Display) -> Self {
        Landed::Stopped {
            taken,
            code: RefusalCode::Internal,
            why: format!("copy failed: {e}"),
        }
    }
}

/// The host addresses of `pieces` (this region's segments), appended to `out` as raw
/// slices for the kernel: a read's bytes sent from them, a write's received into them.
fn raw_slices(
    region: &Region,
    pieces: &[crate::layout::Segment],
    out: &mut Vec<RawSlice>,
) -> Result<(), crate::region::RegionError> {
    for piece in pieces {
        out.push(RawSlice::new(region.host_segment_ptr(piece)?, piece.len));
    }
    Ok(())
}

/// An operation refused, the connection going on: the code and the text the peer is told.
type Refusal = (RefusalCode, String);

/// Why a connection ends.
enum End {
    /// The peer closed it (or went idle) between frames.
    Clean,
    /// An error after which the stream cannot be trusted; `Some` = tell the peer.
    Error(DataError, Option<RefusalCode>),
}

async fn serve_connection(
    stream: TcpStream,
    addr: SocketAddr,
    shared: &Shared,
    hello: &AtomicBool,
) {
    let _ = stream.set_nodelay(true);
    let (r, w) = stream.into_split();
    let id = shared.next_connection.fetch_add(1, Ordering::Relaxed);
    let mut nonce = [0u8; NONCE_BYTES];
    nonce[..8].copy_from_slice(&shared.nonce_seed.to_le_bytes());
    nonce[8..].copy_from_slice(&id.to_le_bytes());
    let mut conn = Conn {
        shared,
        r,
        w,
        nonce,
        sealer: None,
        opener: None,
        peer: addr.to_string(),
        rank: None,
        meta: Vec::new(),
        segments: Vec::new(),
        blocks: Vec::new(),
        pieces: Vec::new(),
        dst: Vec::new(),
        chunk_blocks: Vec::new(),
        low_water: 1,
    };
    let end = match conn.handshake().await {
        Ok(()) => {
            hello.store(true, Ordering::Release);
            conn.serve().await
        }
        Err(end) => end,
    };
    if let End::Error(error, code) = end {
        shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(peer = %conn.peer, %error, "data connection closed after an error");
        if let Some(code) = code {
            let _ = timeout(
                ERROR_SEND_TIMEOUT,
                conn.send_error(0, code, &error.to_string()),
            )
            .await;
        }
    }
}

impl Conn<'_> {
    fn protocol(&self, detail: impl Into<String>) -> DataError {
        DataError::Protocol {
            peer: self.peer.clone(),
            detail: detail.into(),
        }
    }

    async fn handshake(&mut self) -> Result<(), End> {
        let limit = self.shared.config.frame_read_timeout;
        let deadline = tokio::time::Instant::now() + limit;
        if let Some(key) = self.shared.key.as_ref() {
            let (sealer, opener) = tokio::time::timeout_at(
                deadline,
                session(&mut self.r, &mut self.w, key, false, &self.peer),
            )
            .await
            .map_err(|_| {
                End::Error(
                    self.protocol(format!("no handshake within {limit:?}")),
                    None,
                )
            })?
            .map_err(classify)?;
            self.sealer = Some(sealer);
            self.opener = Some(opener);
        }
        let head = tokio::time::timeout_at(
            deadline,
            read_head(
                &mut self.r,
                self.opener.as_mut(),
                &mut self.meta,
                &self.peer,
                "hello",
            ),
        )
        .await
        .map_err(|_| End::Error(self.protocol(format!("no Hello within {limit:?}")), None))?
        .map_err(classify)?;
        if head.op != Op::Hello {
            return Err(End::Error(
                self.protocol(format!("{:?} before Hello", head.op)),
                Some(RefusalCode::Malformed),
            ));
        }
        let rank = frame::decode_hello(&self.meta)
            .map_err(|e| End::Error(self.protocol(e.to_string()), Some(RefusalCode::Malformed)))?;
        self.peer = format!("{rank}@{}", self.peer);
        self.rank = Some(rank);
        let ok = HelloOk {
            nonce: self.nonce,
            blocks: self.shared.region.blocks(),
            block_bytes: self.shared.region.block_bytes() as u64,
            rank: self.shared.me.clone(),
        };
        let header = Header {
            op: Op::HelloOk,
            flags: 0,
            seq: head.seq,
            meta_len: 0,
            data_len: 0,
        };
        let meta = frame::encode_hello_ok(&ok);
        write_frame(&mut self.w, header, &meta, &[], self.sealer.as_mut())
            .await
            .map_err(|e| End::Error(io_error(&self.peer, "hello", e), None))
    }

    async fn serve(&mut self) -> End {
        loop {
            busy_poll(&self.r, self.shared.config.busy_poll).await;
            let mut first = [0u8; 1];
            // Wait for the next frame's first byte under the idle limit, the rest under the
            // frame limit: a stalled peer holds a connection for bounded time.
            match timeout(self.shared.config.idle_timeout, self.r.peek(&mut first)).await {
                Err(_) => {
                    tracing::debug!(peer = %self.peer, "idle data connection closed");
                    return End::Clean;
                }
                Ok(Ok(0)) => return End::Clean,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return End::Error(io_error(&self.peer, "idle", e), None),
            }
            let limit = self.shared.config.frame_read_timeout;
            let result = match timeout(limit, self.one_frame()).await {
                Ok(result) => result,
                Err(_) => Err(End::Error(
                    self.protocol(format!("frame not complete within {limit:?}")),
                    None,
                )),
            };
            if let Err(end) = result {
                return end;
            }
        }
    }

    /// Reads and answers one frame. `Err` ends the connection.
    async fn one_frame(&mut self) -> Result<(), End> {
        let head = read_head(
            &mut self.r,
            self.opener.as_mut(),
            &mut self.meta,
            &self.peer,
            "frame",
        )
        .await
        .map_err(classify)?;
        let access = match head.op {
            Op::Write => Access::Write,
            Op::Read => Access::Read,
            other => {
                return Err(End::Error(
                    self.protocol(format!("unexpected {other:?} frame from a client")),
                    Some(RefusalCode::Malformed),
                ))
            }
        };
        // The header was valid, so its data length is known: a refused operation's data is
        // read and discarded, and the connection stays in step.
        let request = match self.check_op(&head, access) {
            Ok(request) => request,
            Err((code, detail)) => {
                self.discard(head.data_len as usize).await?;
                return self.refuse(head.seq, code, None, &detail).await;
            }
        };
        match access {
            Access::Write => self.write(&head, &request).await,
            Access::Read => self.read(&head, &request).await,
        }
    }

    /// Parses the segments and checks them against the region; fills `self.blocks`.
    fn check_op(
        &mut self,
        head: &Header,
        access: Access,
    ) -> Result<RequestId, (RefusalCode, String)> {
        let malformed = |e: FrameError| (RefusalCode::Malformed, e.to_string());
        let (request, total) =
            frame::decode_op(&self.meta, &mut self.segments).map_err(malformed)?;
        if access == Access::Write && total != u64::from(head.data_len) {
            return Err((
                RefusalCode::Malformed,
                format!(
                    "segments total {total} bytes, frame carries {}",
                    head.data_len
                ),
            ));
        }
        let region_len = self.shared.region.len_bytes() as u64;
        let block_bytes = self.shared.region.block_bytes() as u64;
        self.blocks.clear();
        for seg in &self.segments {
            let end = seg.offset.checked_add(u64::from(seg.len));
            if end.is_none_or(|end| end > region_len) {
                return Err((
                    RefusalCode::OutOfRange,
                    format!(
                        "request {request}: bytes [{}, +{}) outside the region of {} blocks of {block_bytes} bytes",
                        seg.offset, seg.len, self.shared.region.blocks()
                    ),
                ));
            }
            plan::touched_blocks(
                seg.offset,
                u64::from(seg.len),
                block_bytes,
                &mut self.blocks,
            );
        }
        Ok(request)
    }

    fn hello_rank(&self) -> Result<RankInfo, End> {
        self.rank
            .clone()
            .ok_or_else(|| End::Error(self.protocol("operation before Hello"), None))
    }

    /// Reads and drops `len` data bytes of a refused operation, through a small buffer.
    async fn discard(&mut self, len: usize) -> Result<(), End> {
        let mut scratch = [0u8; DISCARD_CHUNK_BYTES];
        let mut left = len;
        while left > 0 {
            let n = left.min(DISCARD_CHUNK_BYTES);
            self.r
                .read_exact(&mut scratch[..n])
                .await
                .map_err(|e| End::Error(io_error(&self.peer, "discarding data", e), None))?;
            left -= n;
        }
        Ok(())
    }

    async fn write(&mut self, head: &Header, request: &RequestId) -> Result<(), End> {
        let rank = self.hello_rank()?;
        let len = head.data_len as usize;
        // Refused before one byte is taken when the grant does not hold now (and checked
        // again, held, around every receive into the blocks).
        let grants = &self.shared.grants;
        if let Err(why) = grants.with_grant(&rank, request, Access::Write, &self.blocks, &mut || {})
        {
            self.discard(len).await?;
            let why = why.to_string();
            return self
                .refuse(head.seq, RefusalCode::NotGranted, Some(request), &why)
                .await;
        }
        let landed = self.land(&rank, request).await?;
        // The next frame (or the rest of a refused write) is waited for byte by byte again.
        self.set_low_water(1)?;
        match landed {
            Landed::All => {
                self.shared.counters.writes.fetch_add(1, Ordering::Relaxed);
                let header = Header {
                    op: Op::WriteOk,
                    flags: 0,
                    seq: head.seq,
                    meta_len: 0,
                    data_len: 0,
                };
                write_frame(&mut self.w, header, &[], &[], self.sealer.as_mut())
                    .await
                    .map_err(|e| End::Error(io_error(&self.peer, "answering a write", e), None))
            }
            Landed::Stopped { taken, code, why } => {
                // The rest of the data keeps the connection in step, then the refusal.
                self.discard(len - taken).await?;
                self.refuse(head.seq, code, Some(request), &why).await
            }
        }
    }

    /// Receives a write's data straight from the socket into its segments' blocks: no
    /// staging copy. Each receive takes at most [`RECV_CHUNK_BYTES`] of what the socket
    /// holds (the rest of one segment and as many of the next as fit: small blocks land
    /// many to a call), without waiting, while the grant of the blocks it fills is held
    /// (waiting for the bytes holds nothing): a slow peer holds no grant, and once the
    /// grant ends no further byte lands. A write stopped that way has landed in part, in
    /// blocks its ended request is about to give back, and is refused.
    async fn land(&mut self, rank: &RankInfo, request: &RequestId) -> Result<Landed, End> {
        let shared = self.shared;
        let region = &shared.region;
        let block_bytes = region.block_bytes() as u64;
        let mut taken = 0usize;
        // Where the next byte lands: segment `i`, `done` bytes into it.
        let (mut i, mut done) = (0usize, 0usize);
        while i < self.segments.len() {
            // This chunk's pieces of the region (one per range each segment's part
            // crosses), and the blocks whose grant must hold while they land.
            self.pieces.clear();
            self.chunk_blocks.clear();
            let (mut j, mut from, mut want) = (i, done, 0usize);
            while j < self.segments.len() && want < RECV_CHUNK_BYTES {
                let seg = self.segments[j];
                let at = seg.offset + from as u64;
                let part = (seg.len as usize - from).min(RECV_CHUNK_BYTES - want);
                if part > 0 {
                    if let Err(e) = region.logical_segments_into(at, part, &mut self.pieces) {
                        return Ok(Landed::internal(taken, e));
                    }
                    plan::touched_blocks(at, part as u64, block_bytes, &mut self.chunk_blocks);
                }
                want += part;
                (j, from) = if from + part == seg.len as usize {
                    (j + 1, 0)
                } else {
                    (j, from + part)
                };
            }
            if want == 0 {
                break;
            }
            self.dst.clear();
            if let Err(e) = raw_slices(region, &self.pieces, &mut self.dst) {
                return Ok(Landed::internal(taken, e));
            }
            self.r
                .readable()
                .await
                .map_err(|e| End::Error(io_error(&self.peer, "receiving data", e), None))?;
            let (r, dst) = (&self.r, &self.dst);
            let mut got = None;
            let granted = shared.grants.with_grant(
                rank,
                request,
                Access::Write,
                &self.chunk_blocks,
                &mut || {
                    // SAFETY: `dst` are this chunk's pieces of the region: inside its memory
                    // (`check_op` checked the logical ranges, the layout mapped them), which
                    // stays mapped as long as the server's shared state this connection
                    // holds; no Rust reference covers them; and the grant of their blocks is
                    // held around this call.
                    got = Some(unsafe { try_recv_raw(r, dst) });
                },
            );
            if let Err(why) = granted {
                return Ok(Landed::Stopped {
                    taken,
                    code: RefusalCode::NotGranted,
                    why: why.to_string(),
                });
            }
            let Some(got) = got else {
                return Ok(Landed::internal(taken, "grant check ran no copy"));
            };
            match got {
                Ok(0) => {
                    let e = std::io::ErrorKind::UnexpectedEof.into();
                    return Err(End::Error(io_error(&self.peer, "receiving data", e), None));
                }
                Ok(n) => {
                    taken += n;
                    // Past what landed: whole segments, then into the one not finished.
                    let mut left = n;
                    while left > 0 && i < self.segments.len() {
                        let rest = self.segments[i].len as usize - done;
                        if left >= rest {
                            (i, done, left) = (i + 1, 0, left - rest);
                        } else {
                            (done, left) = (done + left, 0);
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // Woken again only once more of the write has arrived.
                    let due: usize = self.segments[i..].iter().map(|s| s.len as usize).sum();
                    self.set_low_water((due - done).min(RECV_LOW_WATER_MAX))?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(End::Error(io_error(&self.peer, "receiving data", e), None)),
            }
        }
        Ok(Landed::All)
    }

    /// Sets the socket's receive low-water mark to `bytes` (at least 1) if it is not that.
    fn set_low_water(&mut self, bytes: usize) -> Result<(), End> {
        let bytes = bytes.max(1);
        if self.low_water != bytes {
            let stream: &tokio::net::TcpStream = self.r.as_ref();
            set_low_water(stream, bytes)
                .map_err(|e| End::Error(io_error(&self.peer, "setting SO_RCVLOWAT", e), None))?;
            self.low_water = bytes;
        }
        Ok(())
    }

    /// Sends the bytes of a read, then `ReadOk`, or `Error` for a refusal. They go straight
    /// from the blocks (host memory: [`DataServer::bind_with`] refuses any other) into the
    /// socket, with the grant checked before the first byte and again after the last: the
    /// same generation both times means it held throughout (a revoked grant never holds
    /// again), so the bytes are the blocks' as granted; otherwise the bytes already sent are
    /// disowned by `Error` (`NotGranted`).
    async fn read(&mut self, head: &Header, request: &RequestId) -> Result<(), End> {
        let rank = self.hello_rank()?;
        match self.read_direct(head, request, &rank).await? {
            Ok(()) => {
                self.shared.counters.reads.fetch_add(1, Ordering::Relaxed);
                let header = Header {
                    op: Op::ReadOk,
                    flags: 0,
                    seq: head.seq,
                    meta_len: 0,
                    data_len: 0,
                };
                write_frame(&mut self.w, header, &[], &[], self.sealer.as_mut())
                    .await
                    .map_err(|e| End::Error(io_error(&self.peer, "confirming a read", e), None))
            }
            Err((code, why)) => self.refuse(head.seq, code, Some(request), &why).await,
        }
    }

    /// A read's bytes, sent from the blocks by address, under the grant's generation.
    async fn read_direct(
        &mut self,
        head: &Header,
        request: &RequestId,
        rank: &RankInfo,
    ) -> Result<Result<(), Refusal>, End> {
        let shared = self.shared;
        let generation = match shared
            .grants
            .generation(rank, request, Access::Read, &self.blocks)
        {
            Ok(generation) => generation,
            Err(why) => return Ok(Err((RefusalCode::NotGranted, why.to_string()))),
        };
        let region = &shared.region;
        let mut segments = Vec::new();
        let mut data = Vec::new();
        for seg in &self.segments {
            if let Err(e) =
                region.logical_segments_into(seg.offset, seg.len as usize, &mut segments)
            {
                return Ok(Err((RefusalCode::Internal, format!("copy failed: {e}"))));
            }
        }
        if let Err(e) = raw_slices(region, &segments, &mut data) {
            return Ok(Err((RefusalCode::Internal, format!("copy failed: {e}"))));
        }
        let total: usize = segments.iter().map(|s| s.len).sum();
        let header = Header {
            op: Op::ReadData,
            flags: 0,
            seq: head.seq,
            meta_len: 0,
            data_len: total as u32,
        };
        // A peer that stops taking the bytes holds no grant and no buffer of ours meanwhile,
        // and the connection no longer than the frame time (`serve`).
        // SAFETY: the segments lie inside the region's memory (`check_op` checked the
        // logical ranges, the layout maps them onto its ranges), which stays mapped as long
        // as the server's shared state, held by this connection.
        unsafe { write_frame_raw(&mut self.w, header, &data, self.sealer.as_mut()) }
            .await
            .map_err(|e| End::Error(io_error(&self.peer, "sending read data", e), None))?;
        // Every byte is in the socket's buffer now, taken from the blocks meanwhile.
        Ok(
            match shared
                .grants
                .generation(rank, request, Access::Read, &self.blocks)
            {
                Ok(now) if now == generation => Ok(()),
                Ok(_) => Err((
                    RefusalCode::NotGranted,
                    format!(
                        "request {request}: the read grant was made anew while its bytes were sent"
                    ),
                )),
                Err(why) => Err((
                    RefusalCode::NotGranted,
                    format!("{why} while its bytes were sent"),
                )),
            },
        )
    }

    /// Answers an operation with `Error`, logs it with the peer named, and goes on.
    async fn refuse(
        &mut self,
        seq: u32,
        code: RefusalCode,
        request: Option<&RequestId>,
        detail: &str,
    ) -> Result<(), End> {
        self.shared.counters.refused.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(peer = %self.peer, request = ?request, %code, detail, "data operation refused");
        self.send_error(seq, code, detail)
            .await
            .map_err(|e| End::Error(io_error(&self.peer, "sending a refusal", e), None))
    }

    async fn send_error(
        &mut self,
        seq: u32,
        code: RefusalCode,
        detail: &str,
    ) -> std::io::Result<()> {
        let header = Header {
            op: Op::Error,
            flags: 0,
            seq,
            meta_len: 0,
            data_len: 0,
        };
        let meta = frame::encode_error(code.to_wire(), detail);
        // A peer that failed the Noise handshake has no session: its refusal goes bare.
        write_frame(&mut self.w, header, &meta, &[], self.sealer.as_mut()).await
    }
}

/// Sorts a failed frame read: bad frames and bad tags are answered, IO errors are not.
fn classify(error: DataError) -> End {
    match error {
        DataError::Protocol { .. } => End::Error(error, Some(RefusalCode::Malformed)),
        DataError::Auth { .. } => End::Error(error, Some(RefusalCode::AuthFailed)),
        DataError::PeerClosed { .. } => End::Error(error, None),
        other => End::Error(other, None),
    }
}

const _: () = assert!(HEADER_BYTES < OP_BYTES_MAX);
