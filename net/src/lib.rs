//! The network transport: control messages between workers over ZMTP (ZeroMQ's protocol,
//! our bounded implementation), peers found through a [`Directory`] (the bootstrap server),
//! liveness by heartbeats, and bytes moved by a [`DataPlane`] (TCP or UCX).
//!
//! One [`NetTransport`] per worker process. It binds the worker's control port, registers
//! the worker, and, once a runtime attaches, runs one control loop task that owns every
//! connection to every peer:
//! - peers are dialed lazily, on the first message for them, at the control address the
//!   directory gives; every connection starts with `Hello` (protocol version, role, rank,
//!   incarnation) and the version is checked there;
//! - a reply goes back over whichever connection the peer is reachable on (the one it dialed
//!   us on, or ours to it), so decode's first message is enough for prefill to answer;
//! - heartbeats flow every `heartbeat_interval` on every connection; a peer whose
//!   connections all close, or that is silent for `heartbeat_interval × heartbeats_missed_max`,
//!   is lost: every request depending on it fails `PeerLost` at once, and its cached
//!   directory entry is dropped;
//! - a peer that comes back with a new incarnation is a new peer: the old one is lost, and
//!   messages stamped with the old incarnation are dropped and logged;
//! - every malformed frame is logged with the peer's address, answered with
//!   `ProtocolError`, and costs that one connection.
//!
//! # Layout
//! - `control`: the control loop.
//! - [`directory`]: the [`Directory`] trait, [`StaticDirectory`].
//! - [`data`]: the [`DataPlane`] trait, [`GrantTable`].
//! - [`tcp`]: [`tcp::TcpDataPlane`], the data plane over TCP.
//! - [`ucx`]: [`ucx::UcxPlane`], the data plane over UCX (one-sided, fenced).
//! - [`engine`]: [`engine::start_engine_runtime`], a whole networked runtime assembled
//!   (data plane, bootstrap client, control port, runtime): what embedders call.

mod control;
pub mod data;
pub mod directory;
pub mod engine;
pub mod peers;
pub mod tcp;
pub mod ucx;
mod writers;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_transport::auth::Key;
use handoff_transport::lease::Lease;
use handoff_transport::same_host::PeerProcess;
use handoff_transport::wire::messages::{LayoutDescriptor, WorkerRecord};
use handoff_transport::zmtp::{Router, ZmtpError};
use handoff_transport::{
    BlockId, BlockSlice, EngineId, KvLayout, RankInfo, Region, RequestId, Role,
};
use tokio::sync::mpsc;

pub use data::{Access, DataPlane, GrantTable, PlaneTransfer};
pub use directory::{Directory, StaticDirectory};
pub use engine::{start_engine_runtime, DataTransport, EngineOptions, EngineRuntime, WorkerMemory};
pub use ucx::{same_host_copies_enabled, SAME_HOST_ENV};

use handoff_actors::link::{
    Attach, Inbox, Link, LinkError, ResolveError, ResolveFuture, TransferError, TransferFuture,
};
use handoff_actors::machine::{Peer, PeerMessage};
use handoff_actors::Error;

/// Default interval between heartbeats on a peer connection: NIXL's ~5 s.
pub const HEARTBEAT_INTERVAL_DEFAULT: Duration = Duration::from_secs(5);

/// Default heartbeats a peer may miss before it is lost: with the default interval, a 30 s
/// lease (NIXL's). A closed connection is noticed at once, without waiting for this.
pub const HEARTBEATS_MISSED_MAX_DEFAULT: u32 = 6;

/// Default time to dial a peer (TCP connect, ZMTP handshake, `Hello`/`HelloAck`).
pub const CONNECT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);

/// Default time to get the worker registered at start.
pub const REGISTER_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);

/// Control messages queued from request actors to the control loop. Request actors never
/// wait on it; a full queue fails the send (and with it, that request).
pub const CONTROL_QUEUE_MESSAGES_MAX: usize = 65_536;

/// Messages held for one peer while it is being dialed.
pub const DIAL_QUEUE_MESSAGES_MAX: usize = 4_096;

/// Dials of a peer in a row that may go unanswered (a connection or handshake that did
/// not finish within `connect_timeout`) before the peer is taken as lost: a refused
/// connection is a dead peer at once, a silent one may be a starved process (seen with four
/// vLLM servers on two cores: a first handshake unanswered for 5 s, the next one answered
/// at once). Each try is bounded by `connect_timeout`.
pub const DIAL_ATTEMPTS_MAX: u32 = 3;

/// How a [`NetTransport`] behaves.
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// Where the control port listens (`tcp://HOST:PORT`; port 0 picks one).
    pub control_listen: String,
    /// The host peers should dial, if not the listen host (needed when listening on 0.0.0.0).
    pub advertise_host: Option<String>,
    /// See [`HEARTBEAT_INTERVAL_DEFAULT`].
    pub heartbeat_interval: Duration,
    /// See [`HEARTBEATS_MISSED_MAX_DEFAULT`].
    pub heartbeats_missed_max: u32,
    /// See [`CONNECT_TIMEOUT_DEFAULT`].
    pub connect_timeout: Duration,
    /// See [`REGISTER_TIMEOUT_DEFAULT`].
    pub register_timeout: Duration,
    /// Shared secret: when set, every frame is authenticated and unauthenticated peers refused.
    pub key: Option<Key>,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            control_listen: "tcp://127.0.0.1:0".into(),
            advertise_host: None,
            heartbeat_interval: HEARTBEAT_INTERVAL_DEFAULT,
            heartbeats_missed_max: HEARTBEATS_MISSED_MAX_DEFAULT,
            connect_timeout: CONNECT_TIMEOUT_DEFAULT,
            register_timeout: REGISTER_TIMEOUT_DEFAULT,
            key: None,
        }
    }
}

/// Errors starting the network transport.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The control port could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        source: ZmtpError,
    },
    /// The worker could not be registered before the deadline.
    #[error("registration failed: {0}")]
    Register(String),
    /// No data plane could serve the worker's memory, or the chosen one failed to start.
    #[error("data plane: {0}")]
    DataPlane(String),
    /// The runtime on top of the transport could not start.
    #[error(transparent)]
    Runtime(handoff_actors::Error),
    /// A non-loopback address without a shared secret or an explicit `insecure` opt-out.
    #[error(transparent)]
    Exposed(#[from] handoff_bootstrap::exposure::Exposed),
    /// Listening on every interface (`0.0.0.0`, `::`) without an advertised host, and no
    /// interface could be found that reaches the bootstrap server: peers would not know
    /// where to dial.
    #[error("no host to advertise for {listen}: {detail}; pass an advertised host (--advertise-host, advertise_host=)")]
    NoAdvertisedHost {
        /// The listen address.
        listen: String,
        /// Why none was found.
        detail: String,
    },
}

/// What a peer told us about its data plane in `Hello`/`HelloAck`: where its blocks are
/// and how to reach them, so running transfers never wait on the bootstrap server.
#[derive(Clone, Debug)]
pub(crate) struct PeerInfo {
    /// Its [`DataPlane::data_descriptor`] (e.g. a UCX worker address).
    pub(crate) data_descriptor: Vec<u8>,
    /// Its layout as it sent it, and as checked ([`LayoutDescriptor::to_layout`]); `None`
    /// when it sent none (a request with it then fails by name before a byte moves).
    pub(crate) layout: Option<(LayoutDescriptor, KvLayout)>,
    /// Our writer's lease with it on this connection (one-sided writes are posted only
    /// while it holds): extended by the control loop when the peer proves it heard us,
    /// revoked when we lose it.
    pub(crate) lease: Arc<Lease>,
    /// Its process, when it offered its pid and the kernel shows it holds the other end of
    /// this connection on this host: watched when it is a lost writer, and the lane's
    /// partner when `copies`.
    pub(crate) process: Option<Arc<PeerProcess>>,
    /// Same-host copies with its memory: it welcomes them, our plane makes them
    /// ([`DataPlane::same_host_copies`]) and its memory is reachable that way.
    pub(crate) copies: bool,
    /// While that check runs (off the control loop): turns `true` when it is done,
    /// whatever it found. `None`: no check was started.
    pub(crate) verifying: Option<tokio::sync::watch::Receiver<bool>>,
    /// The incarnation it announced on this connection.
    pub(crate) incarnation: u64,
    /// Its rank's processes of earlier connections: what a quarantine of a request that
    /// one of them held watches ([`writers::WriterHistory::watch`]).
    pub(crate) writers: writers::WriterHistory<Arc<PeerProcess>>,
}

/// How long a transfer waits for the same-host check of its connection (a peer that offered
/// its pid) before UCX carries it. Device memory: the first transfer through UCX would map
/// the peer's CUDA IPC handles in UCX's cache, and a handle maps once per context, so the
/// plane's own IPC lane could never open them after. Host memory: the first transfer
/// through UCX unpacks the peer's keys, which an older UCX (before 1.19) does in a forked
/// copy of this process first (`ucx::rkey`): with an engine's address space and its cores
/// busy that fork took a second and more (four vLLM servers on two cores), where the kernel
/// copy the check opens takes a system call. The check itself takes milliseconds.
pub const SAME_HOST_CHECK_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// How long [`Link::unwatched`] waits for a connection to a decode request's prefill ranks
/// and for the check of who they are: a rank not known by then counts as one this worker
/// cannot watch (the request then pulls, which needs no watch).
pub const WATCH_CHECK_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// How often a quarantine looks whether a lost writer's process has exited (one `poll` of
/// its pidfd).
pub const WRITER_EXIT_POLL: std::time::Duration = std::time::Duration::from_millis(250);

/// Write grants (transfer info) remembered, at most; the oldest are forgotten first, and a
/// write under a forgotten grant fails by name.
pub const WRITE_GRANTS_REMEMBERED_MAX: usize = 1 << 16;

/// Which write grants came while we were continuously connected to their peer.
///
/// A peer that takes us as lost closes every connection with us and fails the requests it
/// granted us; if we then reconnect (we were stopped, or cut off, and come back), the new
/// connection's lease is good, but those grants are not: the peer may have given the
/// blocks back. So each peer has an epoch, bumped whenever we are left with no connection
/// to it at all, and a grant is written under only in the epoch it came in. Shared between
/// the control loop (records, bumps) and the links (check before a write).
#[derive(Debug, Default)]
pub(crate) struct WriteGrants {
    epochs: BTreeMap<Peer, u64>,
    granted: BTreeMap<RequestId, Vec<(Peer, u64)>>,
    /// Request ids in the order their first grant came (some may be forgotten already).
    order: std::collections::VecDeque<RequestId>,
}

impl WriteGrants {
    /// `peer` granted writes for `id` over a connection of the current epoch.
    pub(crate) fn record(&mut self, id: &RequestId, peer: &Peer) {
        let epoch = self.epochs.get(peer).copied().unwrap_or(0);
        match self.granted.get_mut(id) {
            Some(grants) => {
                grants.retain(|(p, _)| p != peer);
                grants.push((peer.clone(), epoch));
            }
            None => {
                self.granted.insert(id.clone(), vec![(peer.clone(), epoch)]);
                self.order.push_back(id.clone());
            }
        }
        while self.granted.len() > WRITE_GRANTS_REMEMBERED_MAX {
            match self.order.pop_front() {
                Some(old) => {
                    self.granted.remove(&old);
                }
                None => break,
            }
        }
        if self.order.len() > 2 * WRITE_GRANTS_REMEMBERED_MAX {
            let granted = &self.granted;
            self.order.retain(|id| granted.contains_key(id));
        }
    }

    /// Every connection with `peer` is gone: its grants so far are void.
    pub(crate) fn disconnected(&mut self, peer: &Peer) {
        *self.epochs.entry(peer.clone()).or_default() += 1;
    }

    /// Whether `peer`'s grant for `id` came in the current epoch.
    pub(crate) fn holds(&self, id: &RequestId, peer: &Peer) -> bool {
        let epoch = self.epochs.get(peer).copied().unwrap_or(0);
        self.granted
            .get(id)
            .is_some_and(|g| g.iter().any(|(p, e)| p == peer && *e == epoch))
    }

    /// The request ended here.
    pub(crate) fn forget(&mut self, id: &RequestId) {
        self.granted.remove(id);
    }
}

/// Peers' [`PeerInfo`], learned at connect; replaced when a peer reconnects.
pub(crate) type PeerData = Arc<Mutex<BTreeMap<RankInfo, PeerInfo>>>;

/// What the control loop is asked to do.
pub(crate) enum Cmd {
    Send {
        to: Peer,
        id: RequestId,
        msg: PeerMessage,
    },
    /// Connect to the peer if no connection is up or on its way.
    Connect { peer: Peer },
}

/// One worker's network transport. Build with [`NetTransport::bind`], then hand it to the
/// runtime as `TransportChoice::Custom(Arc::new(transport))`.
pub struct NetTransport {
    cfg: NetConfig,
    rank: RankInfo,
    role: Role,
    incarnation: u64,
    control_address: String,
    directory: Arc<dyn Directory>,
    data: Arc<dyn DataPlane>,
    router: Mutex<Option<Router>>,
}

/// A number that grows every time a worker process starts: the wall clock in nanoseconds.
/// It must grow, not merely differ: the bootstrap server takes a higher incarnation of a
/// rank as a restart and refuses a lower one as a conflict. (This is the real-process path;
/// the simulator has its own transport and never calls it.)
fn new_incarnation() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

impl NetTransport {
    /// Binds the control port and registers this worker with the directory (retrying
    /// within `register_timeout`). A worker that cannot register does not start: the
    /// error names the bootstrap server and the last failure (seed 001: a registration
    /// failure must not be logged and forgotten).
    pub async fn bind(
        cfg: NetConfig,
        rank: RankInfo,
        role: Role,
        directory: Arc<dyn Directory>,
        data: Arc<dyn DataPlane>,
    ) -> Result<NetTransport, NetError> {
        let router = Router::bind_with(
            &cfg.control_listen,
            cfg.key.clone(),
            handoff_transport::wire::unauthenticated_refusal(),
        )
        .await
        .map_err(|source| NetError::Bind {
            addr: cfg.control_listen.clone(),
            source,
        })?;
        let local = router.local_addr();
        let host = match (&cfg.advertise_host, local.ip()) {
            (Some(host), _) => host.clone(),
            (None, ip) if ip.is_unspecified() => {
                // Registering 127.0.0.1 would send peers on other hosts to themselves.
                return Err(NetError::NoAdvertisedHost {
                    listen: cfg.control_listen.clone(),
                    detail: "listening on every interface".into(),
                });
            }
            (None, ip) => ip.to_string(),
        };
        let control_address = format!("tcp://{host}:{}", local.port());
        let incarnation = new_incarnation();
        let record = WorkerRecord {
            rank: rank.clone(),
            role,
            incarnation,
            control_address: control_address.clone(),
            data_address: data.address(),
            data_descriptor: data.data_descriptor(),
        };
        match tokio::time::timeout(cfg.register_timeout, directory.register(record)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(NetError::Register(e.to_string())),
            Err(_) => {
                return Err(NetError::Register(format!(
                    "no answer within {:?}",
                    cfg.register_timeout
                )))
            }
        }
        tracing::info!(%rank, %role, %control_address, incarnation, "worker registered");
        Ok(NetTransport {
            cfg,
            rank,
            role,
            incarnation,
            control_address,
            directory,
            data,
            router: Mutex::new(Some(router)),
        })
    }

    /// Where peers reach this worker's control port.
    pub fn control_address(&self) -> &str {
        &self.control_address
    }

    /// This worker's incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }
}

impl Attach for NetTransport {
    fn attach(
        &self,
        rank: RankInfo,
        role: Role,
        inbox: Inbox,
        _region: Arc<Region>,
    ) -> Result<Arc<dyn Link>, Error> {
        if rank != self.rank || role != self.role {
            return Err(Error::Config(format!(
                "runtime is {role} {rank} but its transport was bound for {} {}",
                self.role, self.rank
            )));
        }
        let router = self.router.lock().unwrap_or_else(|e| e.into_inner()).take();
        let router = router.ok_or_else(|| {
            Error::Config("this transport is already attached to a runtime".into())
        })?;
        let descriptor = self.data.descriptor();
        let layout = descriptor.to_layout().map_err(|e| {
            Error::Config(format!(
                "this worker's data plane describes a bad layout: {e}"
            ))
        })?;
        let (cmds, cmd_rx) = mpsc::channel(CONTROL_QUEUE_MESSAGES_MAX);
        let peer_data: PeerData = Arc::default();
        let met: Arc<tokio::sync::Notify> = Arc::default();
        let write_grants: Arc<Mutex<WriteGrants>> = Arc::default();
        let metrics = inbox.metrics().clone();
        let task = control::spawn(control::Setup {
            cfg: self.cfg.clone(),
            me: rank.clone(),
            role,
            incarnation: self.incarnation,
            inbox,
            router,
            directory: self.directory.clone(),
            data: self.data.clone(),
            descriptor,
            layout: layout.clone(),
            peer_data: peer_data.clone(),
            met: met.clone(),
            write_grants: write_grants.clone(),
            cmds: cmd_rx,
        });
        let siblings = Arc::default();
        tokio::spawn(find_siblings(
            self.directory.clone(),
            rank.clone(),
            Arc::clone(&siblings),
            self.cfg.register_timeout,
        ));
        Ok(Arc::new(NetLink {
            loss_timeout: self.cfg.heartbeat_interval * self.cfg.heartbeats_missed_max,
            peer_data,
            met,
            write_grants,
            me: rank,
            siblings,
            cmds,
            directory: self.directory.clone(),
            layout,
            data: self.data.clone(),
            task,
            metrics,
        }))
    }
}

/// One runtime's view of the network transport.
struct NetLink {
    /// How long the control loop goes without hearing a peer before it takes it as lost.
    loss_timeout: std::time::Duration,
    peer_data: PeerData,
    /// Woken whenever the control loop learns a connection ([`Link::unwatched`] waits).
    met: Arc<tokio::sync::Notify>,
    /// Which write grants came in the current connection epoch with their peer.
    write_grants: Arc<Mutex<WriteGrants>>,
    me: RankInfo,
    /// The other ranks of this engine at this dp rank, filled by a lookup at attach.
    siblings: Arc<Mutex<Vec<Peer>>>,
    cmds: mpsc::Sender<Cmd>,
    directory: Arc<dyn Directory>,
    /// This worker's layout (its data plane's descriptor).
    layout: KvLayout,
    data: Arc<dyn DataPlane>,
    task: tokio::task::JoinHandle<()>,
    /// Counts the bytes each transfer moved (`handoff_transfer_bytes_total`).
    metrics: Arc<handoff_actors::Metrics>,
}

/// The logical bytes of each block a transfer between this rank (holding `mine`) and
/// `peer` (holding `theirs`) moves ([`BlockSlice::spans_for_ranks`]): whole blocks between
/// ranks holding the same layers and TP size, the layers both hold between pipeline
/// stages, the KV heads the destination takes from the source between TP sizes; empty
/// when nothing moves.
pub(crate) fn layer_slices(
    me: &RankInfo,
    mine: &KvLayout,
    peer: &RankInfo,
    theirs: &KvLayout,
    write: bool,
) -> Result<Vec<BlockSlice>, TransferError> {
    let (src, src_layout, dst, dst_layout) = if write {
        (me, mine, peer, theirs)
    } else {
        (peer, theirs, me, mine)
    };
    BlockSlice::spans_for_ranks(src, src_layout, dst, dst_layout).map_err(|source| {
        TransferError::Pairing {
            src: src.to_string(),
            dst: dst.to_string(),
            source: Box::new(source),
        }
    })
}

/// Whether blocks a peer names in its own memory (its transfer info, its `Ready`) can be
/// acted on, checked on arrival before a byte moves: the peer described a layout
/// (`theirs`, from its hello), every block it names lies in it, and the two layouts pair
/// (`layer_slices`; `we_send`: we are the source). The error names the peer and what
/// does not check out; the request then fails with a protocol error. The control loop
/// runs it on every such message, and the simulator on every one it delivers.
pub fn check_named_blocks(
    me: &RankInfo,
    mine: &KvLayout,
    peer: &RankInfo,
    theirs: Option<&KvLayout>,
    blocks: &[BlockId],
    we_send: bool,
) -> Result<(), String> {
    let Some(theirs) = theirs else {
        return Err(format!("{peer} described no KV layout when it connected"));
    };
    if let Some(block) = blocks.iter().find(|b| b.0 >= theirs.blocks) {
        return Err(format!(
            "{peer} names block {block}, but its layout has {} blocks",
            theirs.blocks
        ));
    }
    layer_slices(me, mine, peer, theirs, we_send)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

impl NetLink {
    /// One transfer, to or from the peer's memory as its hello described it.
    fn transfer(
        &self,
        id: &RequestId,
        peer: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        write: bool,
        deadline: std::time::Instant,
    ) -> TransferFuture {
        let known = self
            .peer_data
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(peer)
            .cloned();
        let Some(PeerInfo {
            data_descriptor,
            layout: Some((descriptor, theirs)),
            lease,
            process,
            copies,
            verifying,
            ..
        }) = known
        else {
            let peer = peer.clone();
            return Box::pin(async move { Err(TransferError::NoLayout { peer }) });
        };
        let granted = self
            .write_grants
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .holds(id, peer);
        if write && !granted {
            let peer = peer.clone();
            return Box::pin(async move { Err(TransferError::GrantFromOldConnection { peer }) });
        }
        let slices = match layer_slices(&self.me, &self.layout, peer, &theirs, write) {
            // The two ranks hold nothing in common (no layer, no head): nothing to move.
            Ok(slices) if slices.is_empty() => return Box::pin(async { Ok(()) }),
            Ok(slices) => slices,
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        let (data, id, peer) = (self.data.clone(), id.clone(), peer.clone());
        let (metrics, op) = (self.metrics.clone(), if write { "write" } else { "read" });
        let peer_data = self.peer_data.clone();
        Box::pin(async move {
            // The same-host check decides the lane before the first transfer
            // ([`SAME_HOST_CHECK_WAIT_MAX`]).
            let process = match (process, verifying) {
                // The process is only watched, not copied with.
                _ if !copies => None,
                (None, Some(mut done)) => {
                    let until = tokio::time::Instant::now() + SAME_HOST_CHECK_WAIT_MAX;
                    let _ = tokio::time::timeout_at(until, done.wait_for(|d| *d)).await;
                    peer_data
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get(&peer)
                        .filter(|info| Arc::ptr_eq(&info.lease, &lease))
                        .and_then(|info| info.process.clone())
                }
                (process, _) => process,
            };
            // One plane call for every slice (a slice is every block's bytes at one
            // offset: one for whole blocks, a run per layer or head between ranks that
            // hold different parts), under the one deadline and lease.
            let bytes = slices.iter().map(|s| s.len as u64).sum::<u64>() * src.len() as u64;
            let t = PlaneTransfer {
                id: &id,
                peer: &peer,
                peer_data: &data_descriptor,
                peer_layout: &descriptor,
                src,
                dst,
                slices,
                lease: Some(lease.clone()),
                deadline,
                process,
            };
            let fut = if write { data.write(t) } else { data.read(t) };
            fut.await?;
            metrics.bytes_moved(data.name(), op, bytes);
            Ok(())
        })
    }
}

impl Link for NetLink {
    fn me(&self) -> &RankInfo {
        &self.me
    }

    fn send(&self, to: &Peer, id: &RequestId, msg: PeerMessage) -> Result<(), LinkError> {
        // Grant before the message leaves: the peer may act on it at once.
        match &msg {
            PeerMessage::TransferInfo { blocks, .. } => {
                self.data.grants().grant(to, id, Access::Write, blocks)
            }
            PeerMessage::Ready { blocks, .. } => {
                self.data.grants().grant(to, id, Access::Read, blocks)
            }
            _ => {}
        }
        self.cmds
            .try_send(Cmd::Send {
                to: to.clone(),
                id: id.clone(),
                msg,
            })
            .map_err(|_| LinkError::PeerGone(format!("{to} (control queue full or closed)")))
    }

    fn siblings(&self) -> Vec<Peer> {
        self.siblings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn resolve(&self, prefill: &EngineId, dp_rank: Option<u32>) -> ResolveFuture {
        let lookup = self.directory.lookup(prefill);
        let me = self.me.clone();
        let prefill = prefill.clone();
        Box::pin(async move {
            let records = lookup.await?;
            let ranks = records.iter().map(|r| (&r.rank, r.role));
            handoff_actors::link::select_prefill_peers(&me, &prefill, dp_rank, ranks)
        })
    }

    fn write(
        &self,
        id: &RequestId,
        to: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: std::time::Instant,
    ) -> TransferFuture {
        self.transfer(id, to, src, dst, true, deadline)
    }

    fn read(
        &self,
        id: &RequestId,
        from: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: std::time::Instant,
    ) -> TransferFuture {
        self.transfer(id, from, src, dst, false, deadline)
    }

    fn one_sided(&self) -> bool {
        self.data.one_sided()
    }

    fn loss_timeout(&self) -> Option<std::time::Duration> {
        Some(self.loss_timeout)
    }

    /// The peers whose process this worker could not verify on this host at connect, so
    /// that [`Link::writer_exit`] could not watch them: it first connects to any it has not
    /// met and waits for the check (at most [`WATCH_CHECK_WAIT_MAX`] in all; a peer not
    /// known by then counts as unwatched). Every peer known and checked: answered at once.
    fn unwatched(&self, peers: &[Peer]) -> handoff_actors::link::UnwatchedFuture {
        let peers = peers.to_vec();
        {
            let map = self.peer_data.lock().unwrap_or_else(|e| e.into_inner());
            for peer in peers.iter().filter(|p| !map.contains_key(*p)) {
                // A full queue: the wait below runs out and the peer counts as unwatched.
                let _ = self.cmds.try_send(Cmd::Connect { peer: peer.clone() });
            }
        }
        let (peer_data, met) = (self.peer_data.clone(), self.met.clone());
        Box::pin(async move {
            let until = tokio::time::Instant::now() + WATCH_CHECK_WAIT_MAX;
            loop {
                // Armed before looking, so a connection learnt in between still wakes us.
                let met = met.notified();
                tokio::pin!(met);
                met.as_mut().enable();
                let wait = match watch_state(&peer_data, &peers) {
                    Watch::Settled(unwatched) => return unwatched,
                    Watch::Checking(done) => Some(done),
                    Watch::Connecting => None,
                };
                let wait = async {
                    match wait {
                        Some(mut done) => {
                            let _ = done.wait_for(|d| *d).await;
                        }
                        None => met.await,
                    }
                };
                if tokio::time::timeout_at(until, wait).await.is_err() {
                    let map = peer_data.lock().unwrap_or_else(|e| e.into_inner());
                    let watched = |p: &Peer| map.get(p).is_some_and(|i| i.process.is_some());
                    return peers.iter().filter(|p| !watched(p)).cloned().collect();
                }
            }
        })
    }

    /// The processes of the rank that may hold the lost writer's post, each verified at
    /// connect to be a process on this host (its pidfd): polled every [`WRITER_EXIT_POLL`]
    /// until all have exited (a stopped process is alive). The rank's current process, or
    /// (`replaced`) its earlier ones, never the one that took the rank since
    /// (`writers::WriterHistory::watch`): that one never held the lost writer's grants.
    fn writer_exit(&self, peer: &Peer, replaced: bool) -> Option<handoff_actors::link::ExitFuture> {
        let processes = {
            let map = self.peer_data.lock().unwrap_or_else(|e| e.into_inner());
            let info = map.get(peer)?;
            info.writers
                .watch(info.incarnation, info.process.as_ref(), replaced)
        };
        if processes.is_empty() {
            return None;
        }
        Some(Box::pin(async move {
            while processes.iter().any(|p| p.alive()) {
                tokio::time::sleep(WRITER_EXIT_POLL).await;
            }
        }))
    }

    fn transport(&self) -> &'static str {
        self.data.name()
    }

    fn request_ended(&self, id: &RequestId) {
        self.data.grants().revoke(id);
        self.write_grants
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .forget(id);
    }

    fn detach(&self) {
        self.task.abort();
    }
}

/// Where [`Link::unwatched`] stands for a request's peers.
enum Watch {
    /// Every peer is known and checked: these could not be verified.
    Settled(Vec<Peer>),
    /// A peer's check runs: it turns `true` when done.
    Checking(tokio::sync::watch::Receiver<bool>),
    /// A peer has no connection yet.
    Connecting,
}

fn watch_state(peer_data: &PeerData, peers: &[Peer]) -> Watch {
    let map = peer_data.lock().unwrap_or_else(|e| e.into_inner());
    let mut unwatched = Vec::new();
    for peer in peers {
        match map.get(peer) {
            None => return Watch::Connecting,
            Some(info) if info.process.is_some() => {}
            Some(PeerInfo {
                verifying: Some(done),
                ..
            }) if !*done.borrow() => return Watch::Checking(done.clone()),
            Some(_) => unwatched.push(peer.clone()),
        }
    }
    Watch::Settled(unwatched)
}

/// First wait between lookups of this worker's own engine while it is incomplete.
const SIBLING_LOOKUP_BACKOFF_MIN: Duration = Duration::from_millis(50);

/// Looks this worker's engine up until every rank is registered (or `limit` passes), and
/// keeps the other ranks at this dp rank as siblings.
async fn find_siblings(
    directory: Arc<dyn Directory>,
    me: RankInfo,
    siblings: Arc<Mutex<Vec<Peer>>>,
    limit: Duration,
) {
    let deadline = tokio::time::Instant::now() + limit;
    let mut backoff = SIBLING_LOOKUP_BACKOFF_MIN;
    while tokio::time::Instant::now() < deadline {
        match directory.lookup(&me.engine_id).await {
            Ok(records) => {
                let found: Vec<Peer> = records
                    .into_iter()
                    .map(|r| r.rank)
                    .filter(|r| r.dp_rank == me.dp_rank && *r != me)
                    .collect();
                *siblings.lock().unwrap_or_else(|e| e.into_inner()) = found;
                return;
            }
            Err(ResolveError::Fatal(reason)) => {
                tracing::warn!(rank = %me, %reason, "cannot look up sibling ranks");
                return;
            }
            Err(ResolveError::NotReady { .. }) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
    tracing::warn!(rank = %me, "sibling ranks never all registered; failures will not be forwarded to them");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(engine: &str) -> Peer {
        RankInfo::single(engine)
    }

    #[test]
    fn a_write_grant_holds_only_in_the_connection_epoch_it_came_in() {
        let (d, other) = (rank("D"), rank("E"));
        let id = RequestId::new("r");
        let mut grants = WriteGrants::default();
        assert!(!grants.holds(&id, &d), "never granted");
        grants.record(&id, &d);
        assert!(grants.holds(&id, &d));
        assert!(!grants.holds(&id, &other), "granted by another peer");
        // Every connection with D closed: D may have failed the request. Reconnecting
        // does not bring the grant back; a grant made again in the new epoch does.
        grants.disconnected(&d);
        assert!(!grants.holds(&id, &d));
        grants.record(&id, &d);
        assert!(grants.holds(&id, &d));
        grants.forget(&id);
        assert!(!grants.holds(&id, &d));
    }

    #[test]
    fn write_grants_remembered_are_bounded_oldest_first() {
        let d = rank("D");
        let mut grants = WriteGrants::default();
        let ids: Vec<RequestId> = (0..WRITE_GRANTS_REMEMBERED_MAX + 2)
            .map(|i| RequestId::new(format!("r{i}")))
            .collect();
        for id in &ids {
            grants.record(id, &d);
            grants.forget(id); // ended: its order entry stays until pruned
            grants.record(id, &d);
        }
        assert_eq!(grants.granted.len(), WRITE_GRANTS_REMEMBERED_MAX);
        assert!(!grants.holds(&ids[0], &d), "the oldest is forgotten");
        assert!(grants.holds(&ids[ids.len() - 1], &d));
        assert!(grants.order.len() <= 2 * WRITE_GRANTS_REMEMBERED_MAX + 1);
    }
}
