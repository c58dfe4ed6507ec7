//! [`DataClient`]: writes blocks into, and reads blocks from, one peer's [`DataServer`].
//!
//! [`DataServer`]: super::DataServer

use std::io::{IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::timeout_at;

use super::frame::{self, Header, HelloOk, Op, Segment};
use super::io::{busy_poll, io_error, read_exact_vectored, read_head, session, write_frame};
use super::stripes;
use super::{
    CLIENT_CONNECTIONS_MAX, OPS_INFLIGHT_MAX, OP_BYTES_MAX, PLAN_PAIRS_MAX, POOL_IDLE_MAX,
    SEGMENTS_PER_OP_MAX,
};
use crate::auth::Key;
use crate::data::plan::{self, Piece, Plan};
use crate::data::{Access, DataError, RefusalCode};
use crate::noise::{Opener, Sealer};
use crate::region::{BlockSlice, Region};
use crate::types::{BlockId, RankInfo, RequestId};

/// One handshaken connection.
struct Conn {
    r: OwnedReadHalf,
    w: OwnedWriteHalf,
    /// With a shared secret: this connection's Noise session, one half per direction.
    sealer: Option<Sealer>,
    opener: Option<Opener>,
    /// Sequence number of the next operation.
    seq: u32,
    meta: Vec<u8>,
}

struct Inner {
    addr: SocketAddr,
    /// `engine/rank@address`, for errors and logs.
    peer: String,
    me: RankInfo,
    key: Option<Key>,
    /// The server's region and rank, from the first handshake.
    server: HelloOk,
    /// Idle connections and when they were last used; at most [`CLIENT_CONNECTIONS_MAX`].
    pool: Mutex<Vec<(Conn, Instant)>>,
    /// One permit per connection that may exist.
    permits: Arc<Semaphore>,
    /// How long a call waits for the answer to an operation of at most
    /// [`SPIN_OP_BYTES_MAX`](super::SPIN_OP_BYTES_MAX) bytes spinning before it sleeps.
    busy_poll: Duration,
}

/// A client of one peer's data server: pushes blocks into it ([`DataClient::write`]) and
/// pulls blocks from it ([`DataClient::read`]).
///
/// Made once per peer by the runtime's network link with [`DataClient::connect`], which
/// opens and handshakes the first connection. Cheap to clone, and every clone shares one
/// pool of at most [`CLIENT_CONNECTIONS_MAX`] connections, so it can be used from many
/// tasks at once: each call takes an idle connection (or opens one) for its duration,
/// waiting within its deadline when all are busy. A call pipelines its operations (at most
/// [`OPS_INFLIGHT_MAX`] unanswered); a connection on which anything went wrong is closed,
/// never reused. Dropping a call's future stops it at once: nothing keeps moving bytes
/// after it (TCP has no one-sided operations).
///
/// A call of several operations and at least two MiB, on a multi-threaded runtime, runs in
/// stripes: over as many connections at once as the host lends same-host copies lanes
/// ([`lanes_for`](crate::same_host::lanes_for)), each driven by a thread of its own with
/// blocking I/O (the calling thread, in `block_in_place`, is the first). Such a call
/// cannot be dropped halfway (its thread is busy until it ends): it ends when every
/// operation is answered, at the first failure, or at its deadline, and nothing of it
/// moves after it returns.
#[derive(Clone)]
pub struct DataClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for DataClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataClient")
            .field("peer", &self.inner.peer)
            .finish_non_exhaustive()
    }
}

impl DataClient {
    /// Connects to the data server at `addr` as `me`, within `timeout`. `key`: sign every
    /// frame with it and require the server's frames signed. Each call waits for the
    /// answer to a small operation spinning up to
    /// [`CLIENT_BUSY_POLL_DEFAULT`](super::CLIENT_BUSY_POLL_DEFAULT) (see
    /// [`BusyPoll`](super::BusyPoll)).
    pub async fn connect(
        addr: &str,
        me: RankInfo,
        key: Option<Key>,
        timeout: Duration,
    ) -> Result<DataClient, DataError> {
        Self::connect_with(addr, me, key, timeout, super::CLIENT_BUSY_POLL_DEFAULT).await
    }

    /// [`DataClient::connect`], each call waiting for the answer to an operation of at
    /// most [`SPIN_OP_BYTES_MAX`](super::SPIN_OP_BYTES_MAX) bytes spinning up to
    /// `busy_poll` (at most [`BUSY_POLL_MAX`](super::BUSY_POLL_MAX)) before it sleeps:
    /// lower one-block latency for the price of CPU. Zero: sleep at once. A client of a
    /// data server in its own process never spins (it would hold a worker that server
    /// needs).
    pub async fn connect_with(
        addr: &str,
        me: RankInfo,
        key: Option<Key>,
        timeout: Duration,
        busy_poll: Duration,
    ) -> Result<DataClient, DataError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let connect_error = |detail: String| DataError::Connect {
            peer: addr.to_string(),
            detail,
        };
        let resolved = timeout_at(deadline, tokio::net::lookup_host(addr))
            .await
            .map_err(|_| connect_error(format!("name lookup took over {timeout:?}")))?
            .map_err(|e| connect_error(e.to_string()))?
            .next()
            .ok_or_else(|| connect_error("name resolves to no address".into()))?;
        let (conn, server) = open(resolved, &me, key.as_ref(), addr, deadline).await?;
        // A server in this process answers on this runtime's own workers: spinning for
        // its answers would hold one of them from it.
        let here = match (conn.r.local_addr(), conn.r.peer_addr()) {
            (Ok(local), Ok(peer)) => super::server::served_by_this_process(local, peer),
            _ => false,
        };
        let busy_poll = if here { Duration::ZERO } else { busy_poll };
        tracing::debug!(peer = %addr, served_here = here, spin = ?busy_poll, "data client connected");
        let inner = Inner {
            addr: resolved,
            peer: format!("{}@{addr}", server.rank),
            me,
            key,
            server,
            pool: Mutex::new(vec![(conn, Instant::now())]),
            permits: Arc::new(Semaphore::new(CLIENT_CONNECTIONS_MAX)),
            busy_poll: busy_poll.min(super::BUSY_POLL_MAX),
        };
        Ok(DataClient {
            inner: Arc::new(inner),
        })
    }

    /// How long each call waits for the answer to a small operation spinning: what it was
    /// connected with, or zero for a server in this process.
    pub fn busy_poll(&self) -> Duration {
        self.inner.busy_poll
    }

    /// The server's name, `engine/rank@address`.
    pub fn peer(&self) -> &str {
        &self.inner.peer
    }

    /// The server's rank, as it announced it.
    pub fn server_rank(&self) -> &RankInfo {
        &self.inner.server.rank
    }

    /// The server region's block count and block size.
    pub fn server_region(&self) -> (u32, u64) {
        (self.inner.server.blocks, self.inner.server.block_bytes)
    }

    /// Push: writes `src` blocks of `src_region` into the server region's `dst` blocks
    /// (`src[i]` → `dst[i]`), for `request`, before `deadline`. Every block is checked
    /// (ours against our region, theirs against the server's) before anything is sent.
    pub async fn write(
        &self,
        request: &RequestId,
        src_region: &Region,
        src: &[BlockId],
        dst: &[BlockId],
        deadline: Instant,
    ) -> Result<(), DataError> {
        self.write_slices(request, src_region, src, dst, &[], deadline)
            .await
    }

    /// [`DataClient::write`] of some slices of every block (none: whole blocks of equal
    /// size on both sides), for ranks that hold different parts of a block (pipeline
    /// stages' layers, TP ranks' heads): every slice of every block pipelined in one call
    /// (in plans of at most [`PLAN_PAIRS_MAX`] pairs of a block and a slice).
    pub async fn write_slices(
        &self,
        request: &RequestId,
        src_region: &Region,
        src: &[BlockId],
        dst: &[BlockId],
        slices: &[BlockSlice],
        deadline: Instant,
    ) -> Result<(), DataError> {
        self.in_plans(
            request,
            src_region,
            src,
            dst,
            slices,
            Access::Write,
            deadline,
        )
        .await
    }

    /// Pull: reads the server region's `src` blocks into `dst` blocks of `dst_region`
    /// (`src[i]` → `dst[i]`), for `request`, before `deadline`. Bytes land directly in
    /// `dst_region`; `dst` must not list a block twice.
    pub async fn read(
        &self,
        request: &RequestId,
        dst_region: &Region,
        src: &[BlockId],
        dst: &[BlockId],
        deadline: Instant,
    ) -> Result<(), DataError> {
        self.read_slices(request, dst_region, src, dst, &[], deadline)
            .await
    }

    /// [`DataClient::read`] of some slices of every block (none: whole blocks), pipelined in
    /// one call as [`DataClient::write_slices`].
    pub async fn read_slices(
        &self,
        request: &RequestId,
        dst_region: &Region,
        src: &[BlockId],
        dst: &[BlockId],
        slices: &[BlockSlice],
        deadline: Instant,
    ) -> Result<(), DataError> {
        self.in_plans(
            request,
            dst_region,
            dst,
            src,
            slices,
            Access::Read,
            deadline,
        )
        .await
    }

    /// Every slice of every block pair (`local[i]` with `remote[i]`), planned and run a
    /// group of slices at a time, so that one plan holds at most [`PLAN_PAIRS_MAX`] pairs of
    /// a block and a slice; the groups go one after another under the one deadline.
    #[allow(clippy::too_many_arguments)]
    async fn in_plans(
        &self,
        request: &RequestId,
        region: &Region,
        local: &[BlockId],
        remote: &[BlockId],
        slices: &[BlockSlice],
        access: Access,
        deadline: Instant,
    ) -> Result<(), DataError> {
        plan::check_slices(slices.len())?;
        if slices.is_empty() {
            let plan = self.plan(region, local, remote, &[], access)?;
            return self.run(request, region, &plan, access, deadline).await;
        }
        let per_plan = (PLAN_PAIRS_MAX / local.len().max(1)).max(1);
        for group in slices.chunks(per_plan) {
            let plan = self.plan(region, local, remote, group, access)?;
            self.run(request, region, &plan, access, deadline).await?;
        }
        Ok(())
    }

    /// Checks both block lists and cuts the transfer into operations.
    fn plan(
        &self,
        local_region: &Region,
        local: &[BlockId],
        remote: &[BlockId],
        slices: &[BlockSlice],
        access: Access,
    ) -> Result<Plan, DataError> {
        let write = access == Access::Write;
        plan::check_lists(local, remote)?;
        local_region.check_blocks(local)?;
        // TCP moves bytes through the CPU: device memory goes over UCX.
        local_region.check_host("the TCP data client")?;
        let server = &self.inner.server;
        let at = plan::Sliced::all(
            slices,
            write,
            local_region.block_bytes(),
            server.block_bytes,
            &self.inner.peer,
        )?;
        if let Some(&block) = remote.iter().find(|b| b.0 >= server.blocks) {
            return Err(DataError::OutsidePeerRegion {
                peer: self.inner.peer.clone(),
                block,
                blocks: u64::from(server.blocks),
            });
        }
        if !write {
            // Reads land directly in these blocks, through one mutable buffer per piece.
            plan::check_destinations(local)?;
        }
        let pieces: Vec<Piece> = at
            .iter()
            .flat_map(|at| plan::sliced_pieces(local, remote, at))
            .collect();
        Ok(plan::split(&pieces, OP_BYTES_MAX, SEGMENTS_PER_OP_MAX))
    }

    async fn run(
        &self,
        request: &RequestId,
        region: &Region,
        plan: &Plan,
        access: Access,
        deadline: Instant,
    ) -> Result<(), DataError> {
        if plan.ops.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let inner = &self.inner;
        let timed_out = |op: &'static str| DataError::Timeout {
            peer: inner.peer.clone(),
            op,
            after: started.elapsed(),
        };
        let std_deadline = deadline;
        let deadline = tokio::time::Instant::from_std(deadline);
        let permit = timeout_at(deadline, Arc::clone(&inner.permits).acquire_owned())
            .await
            .map_err(|_| timed_out("waiting for a free connection"))?
            .map_err(|_| DataError::Connect {
                peer: inner.peer.clone(),
                detail: "client closed".into(),
            })?;
        let mut conn = match self.checkout() {
            Some(conn) => conn,
            None => self.reopen(deadline).await?,
        };
        // Held until the call ends, one per connection it holds.
        let mut _held = vec![permit];
        let stripes = stripes_for(plan);
        if stripes > 1 {
            let conns;
            (conns, _held) = self.more_conns(conn, _held, stripes, deadline).await;
            if conns.len() > 1 {
                return self
                    .run_striped(conns, request, region, plan, access, started, std_deadline)
                    .await;
            }
            conn = conns.into_iter().next().ok_or_else(|| DataError::Connect {
                peer: inner.peer.clone(),
                detail: "no connection".into(),
            })?;
        }
        match timeout_at(
            deadline,
            conn.pipeline(inner, request, region, plan, access),
        )
        .await
        {
            Ok(Ok(())) => {
                self.checkin(conn);
                Ok(())
            }
            // The connection is dropped: after an error its stream cannot be trusted.
            Ok(Err(error)) => Err(error),
            Err(_) => Err(timed_out(match access {
                Access::Write => "write",
                Access::Read => "read",
            })),
        }
    }

    /// Up to `stripes` connections for one call (with `permits` for them): `first`, then idle or new ones for which a
    /// permit is free now (a striped call never waits for another call's connection, and a
    /// connection that cannot be opened leaves one stripe fewer).
    async fn more_conns(
        &self,
        first: Conn,
        mut permits: Vec<OwnedSemaphorePermit>,
        stripes: usize,
        deadline: tokio::time::Instant,
    ) -> (Vec<Conn>, Vec<OwnedSemaphorePermit>) {
        let mut conns = vec![first];
        while conns.len() < stripes {
            let Ok(permit) = Arc::clone(&self.inner.permits).try_acquire_owned() else {
                break;
            };
            let conn = match self.checkout() {
                Some(conn) => conn,
                None => match self.reopen(deadline).await {
                    Ok(conn) => conn,
                    Err(error) => {
                        tracing::debug!(peer = %self.inner.peer, %error, "no further connection for a striped call");
                        break;
                    }
                },
            };
            conns.push(conn);
            permits.push(permit);
        }
        (conns, permits)
    }

    /// Runs `plan` over `conns` at once, a thread each ([`stripes`](super::stripes)), and
    /// hands back to the pool each connection whose stripe ended clean.
    #[allow(clippy::too_many_arguments)]
    async fn run_striped(
        &self,
        conns: Vec<Conn>,
        request: &RequestId,
        region: &Region,
        plan: &Plan,
        access: Access,
        started: Instant,
        deadline: Instant,
    ) -> Result<(), DataError> {
        let peer = self.inner.peer.as_str();
        let mut std_conns = Vec::with_capacity(conns.len());
        for conn in conns {
            std_conns.push(
                conn.into_std()
                    .map_err(|e| io_error(peer, "preparing a stripe", e))?,
            );
        }
        let job = stripes::Job::new(peer, request, region, plan, access, started, deadline);
        let (result, clean) = tokio::task::block_in_place(|| stripes::run(&mut std_conns, &job));
        for (conn, clean) in std_conns.into_iter().zip(clean) {
            if clean {
                match Conn::from_std(conn) {
                    Ok(conn) => self.checkin(conn),
                    Err(error) => {
                        tracing::debug!(%peer, %error, "a stripe's connection not pooled")
                    }
                }
            }
        }
        result
    }

    /// An idle pooled connection that is still open, if there is one.
    fn checkout(&self) -> Option<Conn> {
        let mut pool = self.inner.pool.lock().unwrap_or_else(|p| p.into_inner());
        while let Some((conn, since)) = pool.pop() {
            let mut probe = [0u8; 1];
            // An idle connection has nothing to read: `WouldBlock`. EOF, stray bytes or an
            // error mean the server closed or broke it.
            let open = matches!(conn.r.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            if open && since.elapsed() < POOL_IDLE_MAX {
                return Some(conn);
            }
        }
        None
    }

    fn checkin(&self, conn: Conn) {
        let mut pool = self.inner.pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < CLIENT_CONNECTIONS_MAX {
            pool.push((conn, Instant::now()));
        }
    }

    async fn reopen(&self, deadline: tokio::time::Instant) -> Result<Conn, DataError> {
        let inner = &self.inner;
        let (conn, server) = open(
            inner.addr,
            &inner.me,
            inner.key.as_ref(),
            &inner.peer,
            deadline,
        )
        .await?;
        if (server.blocks, server.block_bytes, &server.rank)
            != (
                inner.server.blocks,
                inner.server.block_bytes,
                &inner.server.rank,
            )
        {
            return Err(DataError::Protocol {
                peer: inner.peer.clone(),
                detail: format!(
                    "server changed: now {} with {} blocks of {} bytes",
                    server.rank, server.blocks, server.block_bytes
                ),
            });
        }
        Ok(conn)
    }
}

/// Opens a connection and handshakes, before `deadline`.
async fn open(
    addr: SocketAddr,
    me: &RankInfo,
    key: Option<&Key>,
    peer: &str,
    deadline: tokio::time::Instant,
) -> Result<(Conn, HelloOk), DataError> {
    let connect_error = |detail: String| DataError::Connect {
        peer: peer.to_string(),
        detail,
    };
    let handshake = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| connect_error(e.to_string()))?;
        stream
            .set_nodelay(true)
            .map_err(|e| connect_error(e.to_string()))?;
        let (mut r, mut w) = stream.into_split();
        let (mut sealer, mut opener) = match key {
            Some(key) => {
                let (s, o) = session(&mut r, &mut w, key, true, peer).await?;
                (Some(s), Some(o))
            }
            None => (None, None),
        };
        let hello = Header {
            op: Op::Hello,
            flags: 0,
            seq: 0,
            meta_len: 0,
            data_len: 0,
        };
        write_frame(
            &mut w,
            hello,
            &frame::encode_hello(me),
            &[],
            sealer.as_mut(),
        )
        .await
        .map_err(|e| connect_error(format!("sending Hello: {e}")))?;
        let mut meta = Vec::new();
        let head = read_head(&mut r, opener.as_mut(), &mut meta, peer, "handshake").await?;
        let server = match head.op {
            Op::HelloOk => frame::decode_hello_ok(&meta).map_err(|e| DataError::Protocol {
                peer: peer.to_string(),
                detail: e.to_string(),
            })?,
            Op::Error => return Err(refusal(peer, &meta)),
            other => {
                return Err(DataError::Protocol {
                    peer: peer.to_string(),
                    detail: format!("{other:?} instead of HelloOk"),
                })
            }
        };
        let conn = Conn {
            r,
            w,
            sealer,
            opener,
            seq: 1,
            meta: Vec::new(),
        };
        Ok((conn, server))
    };
    timeout_at(deadline, handshake)
        .await
        .map_err(|_| connect_error("no handshake before the deadline".into()))?
}

/// The error for an `Error` frame's metadata.
fn refusal(peer: &str, meta: &[u8]) -> DataError {
    match frame::decode_error(meta) {
        Ok((code, detail)) => match RefusalCode::from_wire(code) {
            Some(code) => DataError::Refused {
                peer: peer.to_string(),
                code,
                detail,
            },
            None => DataError::Protocol {
                peer: peer.to_string(),
                detail: format!("unknown refusal code {code}: {detail}"),
            },
        },
        Err(e) => DataError::Protocol {
            peer: peer.to_string(),
            detail: e.to_string(),
        },
    }
}

/// How many connections a call of `plan` moves its bytes over at once: one per
/// [`LANE_BYTES_MIN`](crate::same_host::LANE_BYTES_MIN) of it, at most the host's cores and
/// [`LANES_ENV`](crate::same_host::LANES_ENV) ([`lanes_for`](crate::same_host::lanes_for),
/// the same-host copies' rule), and one where the runtime has a single thread (a stripe
/// blocks its thread).
fn stripes_for(plan: &Plan) -> usize {
    if plan.ops.len() < 2 {
        return 1;
    }
    if !crate::same_host::may_block_in_place() {
        return 1;
    }
    crate::same_host::lanes_for(plan.total_bytes()).min(plan.ops.len())
}

impl Conn {
    /// The connection out of the runtime's reactor, for a stripe's thread.
    fn into_std(self) -> std::io::Result<stripes::StdConn> {
        let stream = self
            .r
            .reunite(self.w)
            .map_err(|e| std::io::Error::other(e.to_string()))?
            .into_std()?;
        Ok(stripes::StdConn {
            stream,
            sealer: self.sealer,
            opener: self.opener,
            seq: self.seq,
            meta: self.meta,
        })
    }

    /// A stripe's connection back in the runtime's reactor, its receive low-water mark the
    /// default again (the runtime waits for answers of a few bytes).
    fn from_std(conn: stripes::StdConn) -> std::io::Result<Conn> {
        super::io::set_low_water(&conn.stream, 1)?;
        let (r, w) = TcpStream::from_std(conn.stream)?.into_split();
        Ok(Conn {
            r,
            w,
            sealer: conn.sealer,
            opener: conn.opener,
            seq: conn.seq,
            meta: conn.meta,
        })
    }

    /// Sends every operation of `plan` and takes every answer, at most
    /// [`OPS_INFLIGHT_MAX`] unanswered at a time.
    async fn pipeline(
        &mut self,
        inner: &Inner,
        request: &RequestId,
        region: &Region,
        plan: &Plan,
        access: Access,
    ) -> Result<(), DataError> {
        region.check_host("the TCP data client")?;
        let base = self.seq;
        self.seq = self.seq.wrapping_add(plan.ops.len() as u32);
        let window = Semaphore::new(OPS_INFLIGHT_MAX);
        let peer = inner.peer.as_str();
        let Conn {
            r,
            w,
            sealer,
            opener,
            meta,
            ..
        } = self;
        let send = async {
            for k in 0..plan.ops.len() {
                window
                    .acquire()
                    .await
                    .map_err(|_| DataError::Io {
                        peer: peer.into(),
                        detail: "window closed".into(),
                    })?
                    .forget();
                let header = op_header(request, plan, k, access, base.wrapping_add(k as u32), meta);
                let data = match access {
                    Access::Write => local_slices(region, &plan.pieces[plan.ops[k].clone()])?,
                    Access::Read => Vec::new(),
                };
                write_frame(w, header, meta, &data, sealer.as_mut())
                    .await
                    .map_err(|e| io_error(peer, "sending", e))?;
            }
            Ok::<(), DataError>(())
        };
        let recv = async {
            let mut answer = Vec::new();
            for (k, range) in plan.ops.iter().enumerate() {
                let seq = base.wrapping_add(k as u32);
                let bytes = plan.op_bytes(k);
                if bytes <= super::SPIN_OP_BYTES_MAX {
                    busy_poll(r, inner.busy_poll).await;
                }
                let head =
                    read_head(r, opener.as_mut(), &mut answer, peer, "awaiting an answer").await?;
                if check_answer(&head, &answer, access, seq, bytes, peer)? == Answer::DataFollows {
                    let mut bufs = local_slices_mut(region, &plan.pieces[range.clone()])?;
                    read_exact_vectored(r, &mut bufs)
                        .await
                        .map_err(|e| io_error(peer, "receiving read data", e))?;
                    let end = read_head(
                        r,
                        opener.as_mut(),
                        &mut answer,
                        peer,
                        "awaiting a read's confirmation",
                    )
                    .await?;
                    check_read_end(&end, &answer, seq, peer)?;
                }
                window.add_permits(1);
            }
            Ok::<(), DataError>(())
        };
        tokio::try_join!(send, recv).map(|_| ())
    }
}

/// The header of the frame that asks for operation `k` of `plan` as sequence `seq`, its
/// metadata (the request and the server's segments) encoded into `meta`.
pub(super) fn op_header(
    request: &RequestId,
    plan: &Plan,
    k: usize,
    access: Access,
    seq: u32,
    meta: &mut Vec<u8>,
) -> Header {
    let pieces = &plan.pieces[plan.ops[k].clone()];
    let segments = pieces.iter().map(|p| Segment {
        offset: p.remote,
        len: p.len as u32,
    });
    frame::encode_op(request, segments, meta);
    let (op, data_len) = match access {
        Access::Write => (Op::Write, plan.op_bytes(k) as u32),
        Access::Read => (Op::Read, 0),
    };
    Header {
        op,
        flags: 0,
        seq,
        meta_len: 0,
        data_len,
    }
}

/// What the server's answer to an operation says comes next.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Answer {
    /// A write landed: nothing follows.
    Written,
    /// A read's bytes follow, then its confirmation ([`check_read_end`]).
    DataFollows,
}

/// Checks the answer (`head`, its metadata `answer`) to operation `seq` of `bytes` bytes:
/// a refusal, an answer of the wrong kind, sequence or size is the call's error.
pub(super) fn check_answer(
    head: &Header,
    answer: &[u8],
    access: Access,
    seq: u32,
    bytes: usize,
    peer: &str,
) -> Result<Answer, DataError> {
    match (head.op, access) {
        (Op::Error, _) => Err(refusal(peer, answer)),
        (Op::WriteOk, Access::Write) if head.seq == seq => Ok(Answer::Written),
        (Op::ReadData, Access::Read) if head.seq == seq && head.data_len as usize == bytes => {
            Ok(Answer::DataFollows)
        }
        (op, _) => Err(DataError::Protocol {
            peer: peer.into(),
            detail: format!(
                "{op:?} (seq {}, {} data bytes) where the answer to operation {seq} ({bytes} bytes) was due",
                head.seq, head.data_len
            ),
        }),
    }
}

/// Checks the frame after a read's bytes: the bytes count only once the server says its
/// grant held while it took them from its blocks.
pub(super) fn check_read_end(
    end: &Header,
    answer: &[u8],
    seq: u32,
    peer: &str,
) -> Result<(), DataError> {
    match end.op {
        Op::ReadOk if end.seq == seq => Ok(()),
        Op::Error => Err(refusal(peer, answer)),
        op => Err(DataError::Protocol {
            peer: peer.into(),
            detail: format!(
                "{op:?} (seq {}) where the confirmation of read {seq} was due",
                end.seq
            ),
        }),
    }
}

/// The local bytes of `pieces` (logical offsets of `region`), as the physical segments of
/// its ranges, in order: what one write operation sends.
pub(super) fn local_slices<'a>(
    region: &'a Region,
    pieces: &[Piece],
) -> Result<Vec<IoSlice<'a>>, DataError> {
    let mut segments = Vec::new();
    for p in pieces {
        region.logical_segments_into(p.local as u64, p.len, &mut segments)?;
    }
    segments
        .iter()
        // SAFETY: the segments are the region's own (from `logical_segments_into`), inside
        // blocks that `plan` checked and the caller's request owns for the call; nothing
        // writes them meanwhile.
        .map(|seg| Ok(IoSlice::new(unsafe { region.host_bytes(seg) }?)))
        .collect()
}

/// The local bytes of `pieces`, to receive into: as [`local_slices`], mutable.
pub(super) fn local_slices_mut<'a>(
    region: &'a Region,
    pieces: &[Piece],
) -> Result<Vec<IoSliceMut<'a>>, DataError> {
    let mut segments = Vec::new();
    for p in pieces {
        region.logical_segments_into(p.local as u64, p.len, &mut segments)?;
    }
    segments
        .iter()
        // SAFETY: as in `local_slices`; no two pieces overlap (`plan` refused a
        // destination block listed twice, `Sliced::all` slices that overlap in the
        // destination block), so neither do their segments.
        .map(|seg| Ok(IoSliceMut::new(unsafe { region.host_bytes_mut(seg) }?)))
        .collect()
}
