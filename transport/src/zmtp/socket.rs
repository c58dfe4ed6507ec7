//! ROUTER and DEALER sockets over tokio TCP.
//!
//! A [`Router`] accepts connections, runs the handshake under [`HANDSHAKE_TIMEOUT`], and
//! hands every message up with the connection it came from; replies go back to that
//! connection. A [`Dealer`] is one connection to one ROUTER. Every task a socket spawns
//! ends when its connection ends or when the socket is dropped.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncWrite, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::codec::{self, Incoming, SocketType, ZmtpError};
use super::{
    CONNECTIONS_MAX, CONNECTION_INFLIGHT_MAX, HANDSHAKE_TIMEOUT, PENDING_CONNECTIONS_MAX,
    PENDING_IDLE_TIMEOUT, PENDING_PER_SOURCE_MAX, RECV_QUEUE_MESSAGES_MAX, SEND_QUEUES_BYTES_MAX,
    SEND_QUEUE_BYTES_MAX, SEND_QUEUE_MESSAGES_MAX,
};
use crate::admission::{admission, Bound, Limits};
use crate::auth::Key;
use crate::noise::{self, Session};

/// One accepted connection of a [`Router`]; never reused within a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub u64);

/// What a [`Router`] hands up.
#[derive(Debug)]
pub enum RouterEvent {
    /// A peer finished its handshake.
    Connected {
        /// The connection.
        conn: ConnId,
        /// The peer's address.
        peer: SocketAddr,
        /// Our end's address (the listening address, or the interface it was reached on).
        local: Option<SocketAddr>,
    },
    /// A whole message from a peer.
    Message {
        /// The connection it came on.
        conn: ConnId,
        /// The peer's address.
        peer: SocketAddr,
        /// Its frames.
        frames: Vec<Vec<u8>>,
    },
    /// A connection ended (peer closed, protocol violation, or dropped by us).
    Disconnected {
        /// The connection.
        conn: ConnId,
        /// The peer's address.
        peer: SocketAddr,
        /// Why.
        reason: String,
    },
}

/// Parses `tcp://host:port` or `host:port`.
pub(crate) fn parse_addr(addr: &str) -> Result<String, ZmtpError> {
    let hostport = addr.strip_prefix("tcp://").unwrap_or(addr);
    if hostport
        .rsplit_once(':')
        .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
    {
        return Err(ZmtpError::BadAddress(addr.to_string()));
    }
    Ok(hostport.to_string())
}

/// One accepted connection, as the [`Router`] keeps it.
struct Slot {
    tx: mpsc::Sender<Vec<Vec<u8>>>,
    /// Bytes queued to it and not yet written (bounded by [`SEND_QUEUE_BYTES_MAX`]).
    queued: Arc<AtomicUsize>,
    /// Set by [`Router::admit`]: a known peer, exempt from the bounds on pending ones.
    admitted: Arc<AtomicBool>,
    /// Where it came from (for the per-source bound).
    peer: SocketAddr,
    /// Ends the connection at once, unsent messages and all (an eviction, a peer that
    /// does not read): removing the slot alone would leave its task holding both.
    kill: Arc<Notify>,
}

impl Slot {
    /// Ends the connection now (see `kill`); what it had queued leaves `total` at once.
    fn kill(&self, total: &AtomicUsize) {
        unqueue(&self.queued, total, usize::MAX);
        self.kill.notify_one();
    }
}

/// Takes up to `bytes` off a connection's queued count, and as much off the listener's
/// `total`: once a connection's count was taken whole (it was dropped), its writer's later
/// decrements take nothing more.
fn unqueue(queued: &AtomicUsize, total: &AtomicUsize, bytes: usize) {
    let old = queued
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
            Some(q.saturating_sub(bytes))
        })
        .unwrap_or(0);
    total.fetch_sub(old.min(bytes), Ordering::AcqRel);
}

type Senders = Arc<Mutex<BTreeMap<ConnId, Slot>>>;

fn lock(s: &Senders) -> std::sync::MutexGuard<'_, BTreeMap<ConnId, Slot>> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// What one connection's writer drains, and the state the [`Router`] shares with it.
struct Outbox {
    rx: mpsc::Receiver<Vec<Vec<u8>>>,
    queued: Arc<AtomicUsize>,
    admitted: Arc<AtomicBool>,
    kill: Arc<Notify>,
    /// Bytes queued on every connection of the listener together.
    total: Arc<AtomicUsize>,
}

/// Events handed up, each with the permit its connection took (released when taken).
type Events = mpsc::Sender<(RouterEvent, Option<OwnedSemaphorePermit>)>;

/// A bound ROUTER socket.
pub struct Router {
    local: SocketAddr,
    events: mpsc::Receiver<(RouterEvent, Option<OwnedSemaphorePermit>)>,
    senders: Senders,
    accept: JoinHandle<()>,
    stats: Arc<RouterCounters>,
    /// Bytes queued on every connection together (bounded by [`SEND_QUEUES_BYTES_MAX`]).
    total: Arc<AtomicUsize>,
}

/// Bounds a [`Router`] enforced, counted since it was bound (each also logged).
#[derive(Default)]
struct RouterCounters {
    refused_full: AtomicU64,
    refused_pending: AtomicU64,
    refused_source: AtomicU64,
    dropped_slow: AtomicU64,
    dropped_idle: AtomicU64,
}

/// What a [`Router`] refused or dropped to stay within its bounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouterStats {
    /// New connections that met [`CONNECTIONS_MAX`] (a pending one evicted, or refused).
    pub refused_full: u64,
    /// New connections that met [`PENDING_CONNECTIONS_MAX`] (the oldest pending evicted).
    pub refused_pending: u64,
    /// New connections that met [`PENDING_PER_SOURCE_MAX`] (that source's oldest pending
    /// connection evicted).
    pub refused_source: u64,
    /// Connections dropped for not reading their replies ([`SEND_QUEUE_BYTES_MAX`]).
    pub dropped_slow: u64,
    /// Pending connections dropped for sending no whole message in
    /// [`PENDING_IDLE_TIMEOUT`].
    pub dropped_idle: u64,
}

impl Drop for Router {
    fn drop(&mut self) {
        self.accept.abort();
        // Dropping the senders ends every connection's writer, which closes it.
        lock(&self.senders).clear();
    }
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

impl Router {
    /// Binds `addr` (`tcp://host:port`; port 0 picks one) and starts accepting.
    pub async fn bind(addr: &str) -> Result<Router, ZmtpError> {
        Router::bind_with(addr, None, None).await
    }

    /// Binds `addr` and starts accepting; with a key, every connection must complete a Noise
    /// handshake ([`crate::noise`]) within [`HANDSHAKE_TIMEOUT`] before anything it sends
    /// is read beyond the handshake, and every message is sealed. A peer whose handshake
    /// fails is sent `refusal` (one plain frame, the same for everyone) before it is closed,
    /// so a client configured without the secret can say why.
    pub async fn bind_with(
        addr: &str,
        key: Option<Key>,
        refusal: Option<Vec<u8>>,
    ) -> Result<Router, ZmtpError> {
        let sealing = key.map(|key| Arc::new(Sealing { key, refusal }));
        let listener = TcpListener::bind(parse_addr(addr)?).await?;
        let local = listener.local_addr()?;
        let (tx, events) = mpsc::channel(RECV_QUEUE_MESSAGES_MAX);
        let senders: Senders = Arc::default();
        let stats = Arc::new(RouterCounters::default());
        let total = Arc::new(AtomicUsize::new(0));
        let accept = tokio::spawn(accept_loop(
            listener,
            tx,
            (senders.clone(), total.clone()),
            sealing,
            stats.clone(),
        ));
        Ok(Router {
            local,
            events,
            senders,
            accept,
            stats,
            total,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The next event; `None` only if the accept loop has ended. Taking a message frees
    /// one of its connection's [`CONNECTION_INFLIGHT_MAX`] places in the queue.
    pub async fn recv(&mut self) -> Option<RouterEvent> {
        self.events.recv().await.map(|(event, _permit)| event)
    }

    /// Marks `conn` as a known peer (it said a valid hello, or registered): exempt from the
    /// pending bounds from now on (its capacity is the reserve below [`CONNECTIONS_MAX`]).
    pub fn admit(&self, conn: ConnId) {
        if let Some(slot) = lock(&self.senders).get(&conn) {
            slot.admitted.store(true, Ordering::Release);
        }
    }

    /// What the router refused or dropped so far.
    pub fn stats(&self) -> RouterStats {
        let c = &self.stats;
        RouterStats {
            refused_full: c.refused_full.load(Ordering::Relaxed),
            refused_pending: c.refused_pending.load(Ordering::Relaxed),
            refused_source: c.refused_source.load(Ordering::Relaxed),
            dropped_slow: c.dropped_slow.load(Ordering::Relaxed),
            dropped_idle: c.dropped_idle.load(Ordering::Relaxed),
        }
    }

    /// Queues a message to one connection. Never waits. A connection whose queue is full,
    /// in messages or in bytes ([`SEND_QUEUE_BYTES_MAX`]), does not read what it is sent:
    /// it is dropped at once (counted, logged), its queue freed, and `QueueFull` returned.
    /// When every connection's queue together would pass [`SEND_QUEUES_BYTES_MAX`], the
    /// one holding the most is dropped the same way (several slow readers cannot add up).
    pub fn send(&self, conn: ConnId, frames: Vec<Vec<u8>>) -> Result<(), ZmtpError> {
        let bytes: usize = frames.iter().map(Vec::len).sum();
        let mut slots = lock(&self.senders);
        if self.total.load(Ordering::Acquire) + bytes > SEND_QUEUES_BYTES_MAX {
            let most = slots
                .iter()
                .map(|(c, s)| (s.queued.load(Ordering::Acquire), *c))
                .max();
            if let Some((held, victim)) = most.filter(|(held, _)| *held > 0) {
                if let Some(slot) = slots.remove(&victim) {
                    self.stats.dropped_slow.fetch_add(1, Ordering::Relaxed);
                    warn!(peer = %slot.peer, queued = held, max = SEND_QUEUES_BYTES_MAX,
                        "replies queued on every connection together at their bound: dropping the connection that holds the most");
                    slot.kill(&self.total);
                }
            }
        }
        let slot = slots.get(&conn).ok_or(ZmtpError::Closed)?;
        let queued = slot.queued.fetch_add(bytes, Ordering::AcqRel);
        self.total.fetch_add(bytes, Ordering::AcqRel);
        let sent = if queued + bytes > SEND_QUEUE_BYTES_MAX {
            Err(ZmtpError::QueueFull)
        } else {
            slot.tx.try_send(frames).map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => ZmtpError::QueueFull,
                mpsc::error::TrySendError::Closed(_) => ZmtpError::Closed,
            })
        };
        if sent.is_err() {
            unqueue(&slot.queued, &self.total, bytes);
        }
        if matches!(sent, Err(ZmtpError::QueueFull)) {
            self.stats.dropped_slow.fetch_add(1, Ordering::Relaxed);
            warn!(peer = %slot.peer, queued, max = SEND_QUEUE_BYTES_MAX,
                "dropping a connection that does not read its replies");
            if let Some(slot) = slots.remove(&conn) {
                slot.kill(&self.total);
            }
        }
        sent
    }

    /// Bytes queued on every connection together, not yet written.
    pub fn queued_bytes(&self) -> usize {
        self.total.load(Ordering::Acquire)
    }

    /// Closes one connection.
    pub fn disconnect(&self, conn: ConnId) {
        lock(&self.senders).remove(&conn);
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        lock(&self.senders).len()
    }
}

async fn accept_loop(
    listener: TcpListener,
    events: Events,
    (senders, total): (Senders, Arc<AtomicUsize>),
    sealing: Option<Arc<Sealing>>,
    stats: Arc<RouterCounters>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors and the like: wait a little rather than spin.
                warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        {
            let mut slots = lock(&senders);
            let counter = |bound: &Bound| match bound {
                Bound::Full => &stats.refused_full,
                Bound::Pending => &stats.refused_pending,
                Bound::Source => &stats.refused_source,
            };
            let pending = slots
                .iter()
                .filter(|(_, s)| !s.admitted.load(Ordering::Acquire))
                .map(|(c, s)| (*c, s.peer.ip()));
            match admission(slots.len(), pending, peer.ip(), &LIMITS) {
                Ok(None) => {}
                Ok(Some((bound, evicted))) => {
                    counter(&bound).fetch_add(1, Ordering::Relaxed);
                    let old = slots.remove(&evicted).map(|s| {
                        s.kill(&total);
                        s.peer
                    });
                    warn!(%peer, ?bound, evicted = ?old,
                        "at a connection bound: evicted the oldest pending connection");
                }
                Err(bound) => {
                    counter(&bound).fetch_add(1, Ordering::Relaxed);
                    warn!(%peer, ?bound, "refusing connection: every place is a known peer's");
                    continue; // dropping the stream closes it
                }
            }
        }
        let conn = ConnId(NEXT_CONN.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = mpsc::channel(SEND_QUEUE_MESSAGES_MAX);
        let outbox = Outbox {
            rx,
            queued: Arc::default(),
            admitted: Arc::default(),
            kill: Arc::default(),
            total: total.clone(),
        };
        let slot = Slot {
            tx,
            queued: outbox.queued.clone(),
            admitted: outbox.admitted.clone(),
            peer,
            kill: outbox.kill.clone(),
        };
        lock(&senders).insert(conn, slot);
        tokio::spawn(serve(
            stream,
            (peer, conn),
            outbox,
            events.clone(),
            senders.clone(),
            sealing.clone(),
            stats.clone(),
        ));
    }
}

/// This listener's bounds (see `crate::admission`).
const LIMITS: Limits = Limits {
    total: CONNECTIONS_MAX,
    pending: PENDING_CONNECTIONS_MAX,
    per_source: PENDING_PER_SOURCE_MAX,
};

/// One accepted connection: handshake, then read and write until either side ends.
async fn serve(
    stream: TcpStream,
    (peer, conn): (SocketAddr, ConnId),
    outbox: Outbox,
    events: Events,
    senders: Senders,
    sealing: Option<Arc<Sealing>>,
    stats: Arc<RouterCounters>,
) {
    let _ = stream.set_nodelay(true);
    let local = stream.local_addr().ok();
    // At most CONNECTION_INFLIGHT_MAX of this connection's messages wait in the shared
    // queue: a flood on one connection cannot delay another's heartbeats behind it.
    let fair = Arc::new(Semaphore::new(CONNECTION_INFLIGHT_MAX));
    let result = run_connection(
        stream,
        SocketType::Router,
        &[],
        sealing.as_deref(),
        outbox,
        |frames| {
            let (events, fair) = (events.clone(), fair.clone());
            async move {
                let Ok(permit) = fair.acquire_owned().await else {
                    return false;
                };
                let event = RouterEvent::Message { conn, peer, frames };
                events.send((event, Some(permit))).await.is_ok()
            }
        },
        || {
            let events = events.clone();
            async move {
                let _ = events
                    .send((RouterEvent::Connected { conn, peer, local }, None))
                    .await;
            }
        },
    )
    .await;
    if matches!(result, Err(ZmtpError::Idle(_))) {
        stats.dropped_idle.fetch_add(1, Ordering::Relaxed);
    }
    lock(&senders).remove(&conn);
    let reason = match result {
        Ok(()) => "closed".to_string(),
        Err(e) => {
            if matches!(e, ZmtpError::Noise(_)) {
                warn!(%peer, error = %e, "refused a connection: not authenticated (not the same secret, replayed or forged)");
            } else if !matches!(e, ZmtpError::Io(_) | ZmtpError::Closed) {
                warn!(%peer, error = %e, "closing connection: protocol violation");
            }
            e.to_string()
        }
    };
    debug!(%peer, ?conn, %reason, "connection ended");
    let _ = events
        .send((RouterEvent::Disconnected { conn, peer, reason }, None))
        .await;
}

/// Runs a connection after accept/connect: handshake under its deadline, then a reader
/// that hands each message to `deliver` and a writer that drains `outbox`.
async fn run_connection<D, DF, C, CF>(
    stream: TcpStream,
    ours: SocketType,
    identity: &[u8],
    sealing: Option<&Sealing>,
    outbox: Outbox,
    deliver: D,
    connected: C,
) -> Result<(), ZmtpError>
where
    D: Fn(Vec<Vec<u8>>) -> DF,
    DF: std::future::Future<Output = bool>,
    C: FnOnce() -> CF,
    CF: std::future::Future<Output = ()>,
{
    // Whatever is still queued when the connection ends leaves the listener's total.
    let _unsent = Unsent {
        queued: outbox.queued.clone(),
        total: outbox.total.clone(),
    };
    let link = stream
        .local_addr()
        .ok()
        .zip(stream.peer_addr().ok())
        .map(|(l, p)| format!("{l}->{p}"))
        .unwrap_or_default();
    let link = link.as_str();
    let (read, write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let mut writer = BufWriter::new(write);
    let mut both = Joined {
        r: &mut reader,
        w: &mut writer,
    };
    let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
    let late = |_| ZmtpError::HandshakeTimeout(HANDSHAKE_TIMEOUT);
    tokio::time::timeout_at(deadline, codec::handshake(&mut both, ours, identity))
        .await
        .map_err(late)??;
    let session = match sealing {
        None => None,
        Some(Sealing { key, refusal }) => {
            match tokio::time::timeout_at(deadline, noise_handshake(&mut both, ours, key)).await {
                Ok(Ok(session)) => Some(session),
                Ok(Err(e)) => {
                    // A peer without the secret (or with another) is told so in the clear,
                    // with a fixed message, before the connection closes.
                    if let Some(refusal) = refusal {
                        let write = codec::write_message(&mut both, std::slice::from_ref(refusal));
                        let _ = tokio::time::timeout_at(deadline, write).await;
                    }
                    return Err(e);
                }
                Err(e) => return Err(late(e)),
            }
        }
    };
    let (mut sealer, mut opener) = match session {
        Some(s) => (Some(s.sealer), Some(s.opener)),
        None => (None, None),
    };
    connected().await;
    let Outbox {
        rx: mut outbox,
        queued,
        admitted,
        kill,
        total,
    } = outbox;

    let (pong_tx, mut pong_rx) = mpsc::channel::<Vec<u8>>(4);
    let write_half = async move {
        loop {
            tokio::select! {
                biased;
                pong = pong_rx.recv() => match pong {
                    Some(body) => codec::write_command(&mut writer, &body).await?,
                    None => return Ok::<(), ZmtpError>(()),
                },
                msg = outbox.recv() => {
                    let bytes = msg.as_ref().map_or(0, |f| f.iter().map(Vec::len).sum());
                    tracing::trace!(bytes, link, "zmtp: message to write");
                    match (msg, sealer.as_mut()) {
                        (Some(frames), None) => codec::write_message(&mut writer, &frames).await?,
                        (Some(frames), Some(sealer)) => {
                            codec::write_sealed(&mut writer, sealer, &frames).await?;
                        }
                        (None, _) => return Ok(()),
                    }
                    tracing::trace!(bytes, link, "zmtp: message written");
                    unqueue(&queued, &total, bytes);
                }
            }
        }
    };
    let read_half = async move {
        loop {
            let read = async {
                match opener.as_mut() {
                    None => codec::read_message(&mut reader).await,
                    Some(opener) => codec::read_sealed(&mut reader, opener).await,
                }
            };
            // A connection not yet admitted as a peer must send a whole message within
            // PENDING_IDLE_TIMEOUT (idle and trickling connections cannot hold a slot).
            let incoming = if admitted.load(Ordering::Acquire) {
                read.await?
            } else {
                tokio::time::timeout(PENDING_IDLE_TIMEOUT, read)
                    .await
                    .map_err(|_| ZmtpError::Idle(PENDING_IDLE_TIMEOUT))??
            };
            match incoming {
                Incoming::Message(frames) => {
                    tracing::trace!(frames = frames.len(), link, "zmtp: message read");
                    if !deliver(frames).await {
                        return Ok::<(), ZmtpError>(());
                    }
                }
                Incoming::Command(body) => {
                    if let Some(pong) = codec::pong_for(&body) {
                        let _ = pong_tx.try_send(pong);
                    }
                }
            }
        }
    };
    tokio::select! {
        biased;
        // Dropped by the owner (evicted, or not reading): already logged there.
        () = kill.notified() => Err(ZmtpError::Closed),
        r = read_half => r,
        w = write_half => w,
    }
}

/// Takes a connection's unsent bytes out of its listener's total when it ends.
struct Unsent {
    queued: Arc<AtomicUsize>,
    total: Arc<AtomicUsize>,
}

impl Drop for Unsent {
    fn drop(&mut self) {
        unqueue(&self.queued, &self.total, usize::MAX);
    }
}

/// A connection's secret, and what a ROUTER tells a peer that fails the handshake.
struct Sealing {
    key: Key,
    refusal: Option<Vec<u8>>,
}

/// The Noise handshake after ZMTP's: the DEALER (the end that connected) initiates.
async fn noise_handshake<S>(io: &mut S, ours: SocketType, key: &Key) -> Result<Session, ZmtpError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    if ours == SocketType::Dealer {
        let mut initiator = noise::Initiator::new(key, noise::PROLOGUE_ZMTP)?;
        codec::write_handshake(io, &initiator.hello()?).await?;
        let answer = codec::read_handshake(io).await?;
        Ok(initiator.finish(&answer)?)
    } else {
        let responder = noise::Responder::new(key, noise::PROLOGUE_ZMTP)?;
        let hello = codec::read_handshake(io).await?;
        let (answer, session) = responder.answer(&hello)?;
        codec::write_handshake(io, &answer).await?;
        Ok(session)
    }
}

/// A reader and a writer seen as one stream, for the handshake.
struct Joined<'a, R, W> {
    r: &'a mut R,
    w: &'a mut W,
}

impl<R: AsyncRead + Unpin, W: Unpin> AsyncRead for Joined<'_, R, W> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut *self.r).poll_read(cx, buf)
    }
}

impl<R: Unpin, W: AsyncWrite + Unpin> AsyncWrite for Joined<'_, R, W> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut *self.w).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut *self.w).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut *self.w).poll_shutdown(cx)
    }
}

/// A connected DEALER socket: one connection to one ROUTER.
pub struct Dealer {
    peer: String,
    /// The TCP connection's two ends (ours, theirs), as the socket reported them.
    addrs: Option<(SocketAddr, SocketAddr)>,
    outbox: mpsc::Sender<Vec<Vec<u8>>>,
    inbox: mpsc::Receiver<Vec<Vec<u8>>>,
    task: Arc<AbortOnDrop>,
}

impl Dealer {
    /// Connects to `addr` and completes the handshake, all within `timeout`.
    pub async fn connect(
        addr: &str,
        identity: &[u8],
        timeout: std::time::Duration,
    ) -> Result<Dealer, ZmtpError> {
        Dealer::connect_with(addr, identity, timeout, None).await
    }

    /// Connects to `addr` and completes the handshake (with a key, the Noise handshake too:
    /// see [`Router::bind_with`]), all within `timeout`.
    pub async fn connect_with(
        addr: &str,
        identity: &[u8],
        timeout: std::time::Duration,
        key: Option<Key>,
    ) -> Result<Dealer, ZmtpError> {
        let hostport = parse_addr(addr)?;
        let stream = tokio::time::timeout(timeout, TcpStream::connect(&hostport))
            .await
            .map_err(|_| ZmtpError::HandshakeTimeout(timeout))??;
        let _ = stream.set_nodelay(true);
        let addrs = stream.local_addr().ok().zip(stream.peer_addr().ok());
        let (outbox, out_rx) = mpsc::channel(SEND_QUEUE_MESSAGES_MAX);
        let out_rx = Outbox {
            rx: out_rx,
            queued: Arc::default(),
            // Our own connection to a server: no pending bounds apply.
            admitted: Arc::new(AtomicBool::new(true)),
            kill: Arc::default(),
            total: Arc::default(),
        };
        let (in_tx, inbox) = mpsc::channel(RECV_QUEUE_MESSAGES_MAX);
        let sealing = key.map(|key| Sealing { key, refusal: None });
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<(), ZmtpError>>();
        // Told once: connected, or why the handshake failed (a refused secret, by name).
        let ready = Arc::new(Mutex::new(Some(ready_tx)));
        let tell = move |r: Result<(), ZmtpError>| {
            if let Some(tx) = ready.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = tx.send(r);
            }
        };
        let identity = identity.to_vec();
        let peer = addr.to_string();
        let name = peer.clone();
        let task = tokio::spawn(async move {
            let told = tell.clone();
            let result = run_connection(
                stream,
                SocketType::Dealer,
                &identity,
                sealing.as_ref(),
                out_rx,
                |frames| {
                    let in_tx = in_tx.clone();
                    async move { in_tx.send(frames).await.is_ok() }
                },
                || async move { told(Ok(())) },
            )
            .await;
            if let Err(e) = result {
                debug!(peer = %name, error = %e, "dealer connection ended");
                tell(Err(e));
            }
        });
        match tokio::time::timeout(timeout, ready_rx).await {
            Ok(Ok(Ok(()))) => Ok(Dealer {
                peer,
                addrs,
                outbox,
                inbox,
                task: Arc::new(AbortOnDrop(task.abort_handle())),
            }),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(ZmtpError::Closed),
            Err(_) => {
                task.abort();
                Err(ZmtpError::HandshakeTimeout(timeout))
            }
        }
    }

    /// The address this dealer connected to.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The TCP connection's two ends, ours then the peer's (`None` if the socket could not
    /// say).
    pub fn socket_addrs(&self) -> Option<(SocketAddr, SocketAddr)> {
        self.addrs
    }

    /// Queues a message. Never waits: a full queue is `QueueFull`, a dead connection `Closed`.
    pub fn send(&self, frames: Vec<Vec<u8>>) -> Result<(), ZmtpError> {
        self.outbox.try_send(frames).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ZmtpError::QueueFull,
            mpsc::error::TrySendError::Closed(_) => ZmtpError::Closed,
        })
    }

    /// The next message; `None` once the connection has ended.
    pub async fn recv(&mut self) -> Option<Vec<Vec<u8>>> {
        self.inbox.recv().await
    }

    /// True once the connection has ended.
    pub fn is_closed(&self) -> bool {
        self.outbox.is_closed()
    }

    /// Splits into a sending half (cheap to clone) and a receiving half. The connection
    /// lives until the last sending half is dropped or the peer closes it.
    pub fn split(self) -> (DealerSender, DealerReceiver) {
        let Dealer {
            peer,
            addrs: _,
            outbox,
            inbox,
            task,
        } = self;
        (
            DealerSender {
                peer,
                outbox,
                _guard: task,
            },
            DealerReceiver { inbox },
        )
    }
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The sending half of a [`Dealer`]. Clone it freely.
#[derive(Clone)]
pub struct DealerSender {
    peer: String,
    outbox: mpsc::Sender<Vec<Vec<u8>>>,
    _guard: Arc<AbortOnDrop>,
}

impl DealerSender {
    /// The address the dealer connected to.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Queues a message. Never waits: a full queue is `QueueFull`, a dead connection `Closed`.
    pub fn send(&self, frames: Vec<Vec<u8>>) -> Result<(), ZmtpError> {
        self.outbox.try_send(frames).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ZmtpError::QueueFull,
            mpsc::error::TrySendError::Closed(_) => ZmtpError::Closed,
        })
    }

    /// True once the connection has ended.
    pub fn is_closed(&self) -> bool {
        self.outbox.is_closed()
    }
}

/// The receiving half of a [`Dealer`].
pub struct DealerReceiver {
    inbox: mpsc::Receiver<Vec<Vec<u8>>>,
}

impl DealerReceiver {
    /// The next message; `None` once the connection has ended.
    pub async fn recv(&mut self) -> Option<Vec<Vec<u8>>> {
        self.inbox.recv().await
    }
}
