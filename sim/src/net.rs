//! The simulated network, bootstrap server and data transport: [`SimNet`].
//!
//! Runtimes attach through [`SimAttach`] (the actors crate's [`Attach`]) and talk through a
//! [`SimLink`] (its [`Link`]). Nothing is delivered at once: every control message, bootstrap
//! answer, registration and data transfer becomes a timed event in one [`Agenda`], ordered by
//! virtual ms and then as scheduled, which the simulation's main loop runs as time reaches it.
//! Every fault decision (loss, duplication, delay, partition, slow transfer, failed query)
//! is drawn from the network's own seeded stream at the moment the message is sent, so the
//! same seed makes the same decisions in the same order.
//!
//! The bootstrap server's answers come from the real [`Registry`] (registration by
//! incarnation, readiness of an engine, expiry of records whose client went silent) and the
//! runtime's own `select_prefill_peers`; only its availability, its sockets and the network
//! between it and the workers are simulated. Each prefill's client beats the server every
//! [`Timing::bootstrap_heartbeat_ms`] (`Registry::touch`); the server sweeps every
//! [`Timing::sweep_ms`] (`Registry::expire`, closing the expired record's connection), and
//! a client without a connection registers again at its next beat, as the real one does.
//!
//! Failure detection is the real control loop's: each worker owns the net crate's
//! [`PeerTable`] (keyed by worker index) with the control loop's loss timeout (heartbeat interval × beats missed,
//! [`Timing::loss_timeout_ms`]), and sees virtual time only (a fixed epoch plus the virtual
//! ms). A worker connects with a peer as the control loop does: when it sends to a peer it
//! holds no connection with, a lost one included (the dial: the incarnation its hello's
//! answer would announce is adopted at once, and a peer that never answers is lost by the
//! timeout), or when a message of a peer it holds no connection with arrives (the peer's
//! hello). Sends never fail for a lost peer: they dial again, as the control loop does. On
//! its tick, every heartbeat interval ([`Timing::heartbeat_interval_ms`]; one agenda event
//! per worker, not per pair), a worker loses the connected peers the table says are silent
//! (`PeerTable::silent`, then `lose`, then [`Inbox::peer_lost`], as `control.rs` does) and
//! sends every connected peer a heartbeat (`PeerTable::beat`), the beats of one tick
//! travelling together as control messages: delayed as any, cut by control-plane
//! partitions, lost with a crashed or restarted end (a connection dies with its process),
//! never lost or duplicated on their own (a connection is a stream). A received message or
//! beat is heard (`heard`, `heartbeat`); one from a new incarnation is that incarnation's
//! hello (`incarnation`, then `adopt`: a `Restarted` peer is lost first, a `Back` one is
//! not), and one from an incarnation the table no longer holds (`current`) is dropped as
//! stale. A frozen worker neither sends nor hears nor ticks; its missed tick runs as it
//! resumes, before anything reaches it, so the peers it stopped hearing are lost then. The
//! simulator does not answer a beat at once (the control loop does, only to shorten its
//! lease's proof; the simulated lease is the grant's connection, `Node::rkeys`), and
//! closes a connection that carried no request message for longer than a request lives, or
//! for a heartbeat interval when the two share no live request ([`SimNet::engage`], the world's
//! count), on both ends and without a loss (`NetState::tick`), so that only pairs a request
//! depends on, or that talked very recently, are beaten: a thousand workers that beat every
//! peer they ever served spent most of the scale run on heartbeats. A beat still in flight
//! when both ends closed is gone with its connection: it does not open one again (it did,
//! and the open connections of the scale run grew with its length, from 8k to 23k over
//! 400k requests). When the faults end, the liveness phase waits [`SimNet::settle_ms`] for the
//! tables to decide about what they stopped hearing.
//!
//! The data transport moves real bytes between [`Region`]s with RDMA semantics: once
//! posted, a write or read lands when its transfer time is over whether or not the request
//! that posted it still waits for it. At landing it checks that the destination blocks are
//! still owned by the transfer's request; a transfer that lands in blocks their engine has
//! taken back is a use after release, reported as a violation.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use handoff_actors::link::{
    select_prefill_peers, Attach, Inbox, Link, LinkError, ResolveError, ResolveFuture,
    TransferError, TransferFuture,
};
use handoff_actors::machine::{Peer, PeerMessage};
use handoff_actors::{
    BlockId, BlockSlice, EngineId, Error as ActorError, FailureReason, RankInfo, Region, RequestId,
    Role,
};
use handoff_bootstrap::registry::{Origin, RegisterOutcome, Registry};
use handoff_bootstrap::{LostRanks, QueryAnswer, WorkerRecord};
use handoff_net::peers::{Incarnation, PeerTable};
use handoff_transport::data::{Access, GrantTable};

use crate::agenda::Agenda;
use handoff_transport::lease::Lease;
use handoff_transport::zmtp::ConnId;
use handoff_transport::Rank;
use tokio::sync::{oneshot, Notify};

use crate::config::{DataPlane, Faults, MessageKind, Plane, Shape, Timing};
use crate::pool::Pool;
use crate::rng::Rng;
use crate::trace::Fold64;

/// Largest wait between two registration attempts while the bootstrap server is down.
pub const REGISTER_BACKOFF_MS_MAX: u64 = 200;
/// First wait between registration attempts.
pub const REGISTER_BACKOFF_MS_MIN: u64 = 5;
/// Emptied heartbeat lists kept for reuse: about as many as ticks whose beats are in
/// flight at once.
const SPARE_BEAT_LISTS_MAX: usize = 4_096;
/// The bootstrap server's name in failure reasons.
pub const BOOTSTRAP_ADDRESS: &str = "sim-bootstrap:8998";

/// The request index of a simulated request id (`r<index>`).
pub fn req_index(id: &RequestId) -> Option<u64> {
    id.as_str().strip_prefix('r')?.parse().ok()
}

/// What a lying peer names instead of `blocks`: as many, each past the end of its pool of
/// `pool` blocks.
fn past_the_end(blocks: &[BlockId], pool: u32) -> Vec<BlockId> {
    (0..blocks.len())
        .map(|k| BlockId(pool.saturating_add(k as u32)))
        .collect()
}

/// FxHash's multiplicative hasher, for the network's lookup tables (by rank, by request
/// id): their keys are the simulator's own, so SipHash's resistance to chosen keys buys
/// nothing, and nothing iterates these tables (their order never reaches the trace).
#[derive(Clone, Copy, Default)]
struct Fx(u64);

impl Fx {
    fn add(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            self.add(u64::from_le_bytes(w));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A hash map over [`Fx`].
type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<Fx>>;

/// One worker as the network sees it.
struct Node {
    idx: usize,
    role: Role,
    /// The incarnation attached now (or last attached, when down).
    inc: u32,
    up: bool,
    inbox: Option<Inbox>,
    region: Option<Arc<Region>>,
    pool: Option<Arc<Mutex<Pool>>>,
    /// The runtime's own grant table, as the TCP plane keeps it: on the fenced plane every
    /// transfer is checked against it where it lands. Fresh for every incarnation.
    grants: Arc<GrantTable>,
    /// The control loop's liveness decisions, in virtual time. Fresh for every incarnation.
    /// Keyed by worker index (the ranks' order), as cheap to compare as a key can be.
    table: PeerTable<usize>,
    /// The peers it holds a control connection with: these are beaten every tick.
    conns: BTreeMap<usize, Conn>,
    /// The ranks its directory was told it lost, at which incarnation (the bootstrap
    /// client's own marks, in virtual time): a query whose engine holds one fails
    /// `PeerLost` rather than pair a new request with it, until the mark expires, the rank
    /// registers anew, or that very process is heard again. Fresh for every incarnation.
    lost: LostRanks,
    /// Peers it shares a live request with, and how many (the world's count, from a
    /// request's arrival to its settling): a connection to any other closes at the next
    /// tick. Kept across incarnations (the requests outlive them).
    /// Only looked up, never iterated: a hash map (its order never shows).
    engaged: FxMap<usize, u32>,
    /// RDMA: which incarnation granted this worker access for a request, by request and
    /// granting worker, as it learned it (from a delivered `TransferInfo` or `Ready`). A
    /// one-sided transfer targets that registration, so it fails once the granting worker
    /// has restarted (its memory was registered anew; the old key is dead), as on real
    /// hardware. A prefill rank serving several decode ranks holds one grant from each.
    /// With it, the loss count between the two at the time ([`Grant`]): a one-sided write
    /// is posted only while no loss was declared between them since (the writer's lease,
    /// `Link::write`; a declared loss drops the connection its lease was on). Kept across
    /// incarnations, forgotten as the request ends here (`Link::request_ended`).
    rkeys: FxMap<RequestId, Vec<(usize, Grant)>>,
    /// Its bootstrap client's connection to the server (a prefill's): heartbeated every
    /// [`Timing::bootstrap_heartbeat_ms`], registering again on a new one.
    boot: BootConn,
}

/// A worker's bootstrap client, as the server sees it: the real client heartbeats on its
/// connection every interval, reconnecting first if the connection is gone (the server
/// closed it on expiring the record, or the server was unreachable at the last beat), and
/// registers again on every new connection.
#[derive(Clone, Copy, Default)]
struct BootConn {
    /// Registered over a connection still open: its beats refresh the record.
    open: bool,
    /// A registration is on its way (with its own retries); no beat reconnects meanwhile.
    registering: bool,
    /// When the client beats next, virtual ms.
    beat_due: u64,
}

/// One control connection, as one end holds it.
#[derive(Clone, Copy)]
struct Conn {
    /// This end's number, unique in the run: a beat names the end it was sent from, so
    /// one still in flight when both ends closed is known to belong to a dead connection.
    id: u64,
    /// The peer's incarnation it was opened with (the one the table adopted).
    inc: u32,
    /// When it last carried a request's message, virtual ms.
    last: u64,
}

struct Partition {
    group: BTreeSet<usize>,
    one_way: bool,
    plane: Plane,
}

impl Partition {
    fn blocks(&self, from: usize, to: usize) -> bool {
        let (f, t) = (self.group.contains(&from), self.group.contains(&to));
        (f && !t) || (!self.one_way && t && !f)
    }
}

/// What the network counted.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct NetStats {
    /// Control messages handed to the network.
    pub sent: u64,
    /// Control messages delivered to a runtime.
    pub delivered: u64,
    /// Lost by the loss fault or a drop rule.
    pub lost: u64,
    /// Lost to a partition.
    pub partitioned: u64,
    /// Lost because an end crashed or restarted while they were in flight.
    pub dead_end: u64,
    /// Delivered twice.
    pub duplicated: u64,
    /// Delayed by a spike.
    pub spiked: u64,
    /// Heartbeats sent (one per connected peer per tick).
    pub heartbeats: u64,
    /// Heartbeats heard (the rest were cut by a partition or lost with an end).
    pub heartbeats_heard: u64,
    /// Connections closed at a tick because their ends shared no live request
    /// ([`SimNet::engage`]); counted at the end that closed them.
    pub closed_unengaged: u64,
    /// Messages and heartbeats dropped because the receiver's peer table holds another
    /// incarnation of the sender (`PeerTable::current`).
    pub stale: u64,
    /// Transfer infos and `Ready`s that named blocks outside the sender's memory (a lying
    /// peer), refused on arrival (`handoff_net::check_named_blocks`): the request fails
    /// there with a protocol error, before a byte moves.
    pub refused: u64,
    /// Data transfers that landed.
    pub transfers_ok: u64,
    /// Data transfers that failed (an end gone, partitioned, a bad block list).
    pub transfers_failed: u64,
    /// Data transfers slowed down.
    pub transfers_slow: u64,
    /// Reads that landed from source blocks their request no longer owned (garbage read).
    pub stale_source: u64,
    /// Transfers refused at landing because their blocks had been taken back (fenced plane).
    pub fenced: u64,
    /// Bootstrap queries answered.
    pub queries: u64,
    /// Bootstrap queries that failed (server down, error, lost).
    pub queries_failed: u64,
    /// Bootstrap queries refused by the asking worker's lost marks: the engine holds a
    /// worker it lost (`PeerLost`).
    pub queries_refused_lost: u64,
    /// Lost marks cleared because the very process lost was heard again (a freeze).
    pub lost_found: u64,
    /// Registration attempts that failed and were retried.
    pub registrations_retried: u64,
    /// Records the bootstrap server expired: their worker's client had not been heard for
    /// [`Timing::expire_after_ms`] (stopped, crashed, or cut off from the server).
    pub records_expired: u64,
    /// Registrations made again by a client whose connection to the server had gone (the
    /// server expired its record and closed it, or the server was unreachable at a beat).
    pub registered_again: u64,
    /// Peers lost by a worker's peer table (silent past the loss timeout, or restarted),
    /// each reported to the worker's runtime.
    pub peer_lost: u64,
    /// One-sided writes refused before posting: the writer's lease with the peer had ended
    /// (a loss was declared between them since the peer granted the blocks).
    pub lease_refused: u64,
    /// Writes that landed but whose writer saw the completion only after its lease ended:
    /// failed, not done (`ConfirmedLate`, on either plane).
    pub confirmed_late: u64,
    /// Writes a frozen worker posted as it resumed without a lease check (its stop fell
    /// between the check and the post).
    pub posted_unchecked: u64,
    /// Transfers a frozen worker started, held until it resumed.
    pub deferred: u64,
    /// Decode push requests over the RDMA plane that ran as pull: a prefill rank was on
    /// another host (`Link::unwatched`).
    pub pulls_instead: u64,
}

/// Something the network saw that breaks an invariant.
#[derive(Clone, Debug)]
pub struct NetFinding {
    /// Virtual ms.
    pub t_ms: u64,
    /// The request involved.
    pub req: Option<u64>,
    /// What happened.
    pub detail: String,
}

/// The two ends of a transfer and their blocks.
struct Ends<'a> {
    src: (usize, u32),
    dst: (usize, u32),
    src_blocks: &'a [BlockId],
    dst_blocks: &'a [BlockId],
}

/// A control message in flight.
struct Delivery {
    from: usize,
    from_inc: u32,
    to: usize,
    to_inc: u32,
    id: RequestId,
    msg: PeerMessage,
    /// Loss declarations between the two when it was sent: a grant carries the
    /// connection it was made on ([`Grant`]).
    losses: u64,
}

/// A data transfer in flight.
struct Landing {
    src: (usize, u32),
    dst: (usize, u32),
    src_blocks: Vec<BlockId>,
    dst_blocks: Vec<BlockId>,
    /// The request the transfer is for, and whether the source side writes (push) or
    /// the destination side reads (pull): where the grant is checked.
    id: RequestId,
    write: bool,
    /// A one-sided write under a lease: whose, with whom, and the loss count it was
    /// granted at; its completion counts only if the lease still holds when the writer
    /// sees it.
    leased: Option<Leased>,
    reply: oneshot::Sender<Result<(), String>>,
}

/// What happens at a virtual instant. The two largest (a message, a transfer) are boxed:
/// every event is written into its millisecond's queue, most a heartbeat interval ahead,
/// into memory last touched that long ago, so the queue's slots are kept small.
enum NetEvent {
    Deliver(Box<Delivery>),
    Land(Box<Landing>),
    /// A leased write's completion, seen by its writer once it runs again (it was frozen
    /// when the write landed, as a stopped process sees its completions only on resuming).
    Seen {
        leased: Leased,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// A transfer that would end past its deadline: the plane answers at the deadline,
    /// having landed nothing (a one-sided plane force-closes the endpoint then).
    Expire {
        req: Option<u64>,
        reply: oneshot::Sender<Result<(), String>>,
    },
    Query {
        who: (usize, u32),
        prefill: EngineId,
        dp: Option<u32>,
        lost: bool,
        reply: oneshot::Sender<Result<Vec<Peer>, ResolveError>>,
    },
    Register {
        who: (usize, u32),
        backoff_ms: u64,
    },
    /// The bootstrap server's expiry sweep (every [`Timing::sweep_ms`]).
    Sweep,
    /// A worker's heartbeat tick (its control loop's interval).
    Tick {
        worker: usize,
        inc: u32,
    },
    /// The heartbeats one worker sent on one tick, arriving.
    Beats {
        from: (usize, u32),
        beats: Vec<Beat>,
    },
    Heal {
        partition: u64,
    },
    /// A frozen worker resumes.
    Thaw {
        worker: usize,
        at: u64,
    },
    /// A transfer a frozen worker started, posted as it resumes.
    Post(Box<Post>),
}

/// A transfer as its worker starts it, to be posted now or when a frozen worker resumes.
struct Post {
    /// The worker that starts it.
    by: usize,
    id: RequestId,
    src_node: Peer,
    dst_node: Peer,
    /// The two ends' worker indices (`NetState::index`, fixed for the run), looked up
    /// once as the transfer starts.
    src_idx: Option<usize>,
    dst_idx: Option<usize>,
    src: Vec<BlockId>,
    dst: Vec<BlockId>,
    deadline_ms: u64,
    /// RDMA: the grant the worker holds for the request when it starts the transfer (its
    /// lease is checked at the post, even if the request ended in between).
    grant: Option<Grant>,
    /// A write whose lease check passed just before its worker stopped: posted as it
    /// resumes without another (`NetState::stop_in_gap`).
    checked: bool,
    reply: oneshot::Sender<Result<(), String>>,
}

/// One heartbeat on the connection with the `to_inc` incarnation of worker `to`, sent
/// from the sender's end `conn`.
struct Beat {
    to: usize,
    to_inc: u32,
    conn: u64,
    seq: u64,
    echo: u64,
}

/// Which registration granted a worker access for a request, and the loss count between
/// the two when it did: the writer's lease with the peer for that grant.
#[derive(Clone, Copy)]
struct Grant {
    node: (usize, u32),
    losses: u64,
}

/// A one-sided write's lease, as its landing carries it ([`NetEvent::Land`]).
#[derive(Clone, Copy)]
struct Leased {
    /// The writer.
    by: usize,
    /// The target that granted the blocks.
    peer: usize,
    /// Losses declared between the two when it granted them.
    losses: u64,
}

/// One line for the trace, from the network.
pub struct NetNote {
    /// Virtual ms.
    pub t_ms: u64,
    /// The request, if any.
    pub req: Option<u64>,
    /// The text.
    pub text: String,
}

struct NetState {
    /// Every worker, by index.
    nodes: Vec<Node>,
    /// Each worker's index, by rank.
    index: FxMap<RankInfo, usize>,
    ranks: Vec<RankInfo>,
    siblings: Vec<Vec<RankInfo>>,
    /// The bootstrap server's own registry (its rules: incarnations replace, conflicts and
    /// bounds refuse, an engine is ready once every rank registered).
    registry: Registry,
    /// How often the server sweeps its registry for expired records ([`Timing::sweep_ms`]).
    sweep_ms: u64,
    /// The registry's and the peer tables' clock: virtual ms after this (a fixed instant).
    epoch: Instant,
    bootstrap_up: bool,
    partitions: BTreeMap<u64, Partition>,
    faults_on: bool,
    faults: Faults,
    timing: Timing,
    drops: Vec<MessageKind>,
    data_plane: DataPlane,
    /// The cluster's shape: which workers share a host ([`Shape::same_host`]); a worker
    /// watches only its own host's.
    shape: Shape,
    /// Loss declarations so far, by (observer, peer); never reset.
    losses: BTreeMap<(usize, usize), u64>,
    /// The peer's incarnation each observer lost last, by (observer, peer): the one a
    /// quarantine watches (`SimLink::writer_exit`).
    lost_incarnation: BTreeMap<(usize, usize), u32>,
    /// Requests whose peers lie about their memory ([`SimNet::lie_for`]).
    liars: BTreeSet<u64>,
    /// Frozen workers, and when they resume.
    frozen: BTreeMap<usize, u64>,
    /// Frozen workers whose stop has not yet fallen between a write's lease check and its
    /// post: the first write such a worker starts while frozen is taken as checked before
    /// the stop, and posted as it resumes without a check (a real writer's window of one
    /// post, which no time bound covers: decode's quarantine must).
    stop_in_gap: BTreeSet<usize>,
    /// A connection that carried no request message for longer than this closes (ms).
    idle_ms: u64,
    rng: Rng,
    /// Connection ends opened so far (each end's [`Conn::id`]).
    conns_opened: u64,
    agenda: Agenda<NetEvent>,
    wake_at: u64,
    stats: NetStats,
    hash: Fold64,
    notes: Vec<NetNote>,
    findings: Vec<NetFinding>,
    /// A tick's idle connections, kept for the next tick (no allocation per tick).
    idle_scratch: Vec<(usize, bool)>,
    /// Emptied beat lists, for the next ticks to fill (a tick's beats travel in one).
    spare_beats: Vec<Vec<Beat>>,
}

/// The simulated network. Shared by every link (`Arc`); driven by the main loop.
pub struct SimNet {
    state: Mutex<NetState>,
    notify: Notify,
    start: tokio::time::Instant,
}

impl SimNet {
    /// A network for workers `ranks` (indexed by position), with `siblings[i]` the ranks that
    /// serve the same requests as worker `i`, over `data_plane`, on the hosts of `shape`
    /// ([`Shape::same_host`]). Must be made inside the simulation's runtime.
    pub fn new(
        seed: u64,
        ranks: Vec<(RankInfo, Role)>,
        siblings: Vec<Vec<RankInfo>>,
        faults: Faults,
        timing: Timing,
        drops: Vec<MessageKind>,
        (data_plane, shape): (DataPlane, Shape),
    ) -> Arc<Self> {
        let mut nodes = Vec::with_capacity(ranks.len());
        let mut index = FxMap::default();
        for (idx, (rank, role)) in ranks.iter().enumerate() {
            let node = Node {
                idx,
                role: *role,
                inc: 0,
                up: false,
                inbox: None,
                region: None,
                pool: None,
                grants: Arc::default(),
                table: peer_table(&timing),
                conns: BTreeMap::new(),
                lost: lost_ranks(&timing),
                engaged: FxMap::default(),
                rkeys: FxMap::default(),
                boot: BootConn::default(),
            };
            nodes.push(node);
            index.insert(rank.clone(), idx);
        }
        let sweep_ms = timing.sweep_ms();
        let mut state = NetState {
            sweep_ms,
            nodes,
            index,
            ranks: ranks.into_iter().map(|(r, _)| r).collect(),
            siblings,
            registry: Registry::new(),
            epoch: Instant::now(),
            bootstrap_up: true,
            partitions: BTreeMap::new(),
            faults_on: true,
            faults,
            // No request lives longer than its lifetime: a connection idle for longer is
            // one no request waits on.
            idle_ms: u64::try_from(timing.timeouts.lifetime_max().as_millis())
                .unwrap_or(u64::MAX)
                .saturating_add(timing.loss_timeout_ms()),
            timing,
            drops,
            data_plane,
            shape,
            losses: BTreeMap::new(),
            lost_incarnation: BTreeMap::new(),
            liars: BTreeSet::new(),
            frozen: BTreeMap::new(),
            stop_in_gap: BTreeSet::new(),
            rng: Rng::fork(seed, "net"),
            conns_opened: 0,
            agenda: Agenda::new(),
            wake_at: u64::MAX,
            stats: NetStats::default(),
            hash: Fold64::new(),
            notes: Vec::new(),
            findings: Vec::new(),
            idle_scratch: Vec::new(),
            spare_beats: Vec::new(),
        };
        state.agenda.push(sweep_ms, NetEvent::Sweep);
        Arc::new(Self {
            state: Mutex::new(state),
            notify: Notify::new(),
            start: tokio::time::Instant::now(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, NetState> {
        // Single-threaded simulation: a poisoned lock only follows a panic we already record.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Virtual ms since the network was made.
    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// The virtual instant of `t_ms`.
    pub fn instant(&self, t_ms: u64) -> tokio::time::Instant {
        self.start + Duration::from_millis(t_ms)
    }

    /// Wakes when a new event is due before the time the main loop sleeps until.
    pub fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }

    /// Records where the main loop will sleep until, so links wake it for earlier events.
    pub fn set_wake_at(&self, t_ms: u64) {
        self.lock().wake_at = t_ms;
    }

    /// When the next network event is due.
    pub fn next_due(&self) -> Option<u64> {
        self.lock().agenda.next_time()
    }

    /// Gives worker `idx` (incarnation `inc`) its memory before its runtime attaches.
    pub fn set_memory(&self, idx: usize, inc: u32, region: Arc<Region>, pool: Arc<Mutex<Pool>>) {
        let mut st = self.lock();
        if let Some(n) = st.node_mut(idx) {
            n.inc = inc;
            n.region = Some(region);
            n.pool = Some(pool);
        }
    }

    /// Faults on (safety phase) or off (liveness phase: delays only).
    pub fn set_faults_on(&self, on: bool) {
        self.lock().faults_on = on;
    }
    /// Request `req`'s peers lie about their memory ([`crate::config::Faults::liar_ppm`]):
    /// decode's transfer info (an even `req`) or prefill's `Ready` (an odd one, pull) names
    /// blocks past the end of the sender's pool.
    pub fn lie_for(&self, req: u64) {
        self.lock().liars.insert(req);
    }

    /// Bootstrap server up or down.
    pub fn set_bootstrap_up(&self, up: bool) {
        self.lock().bootstrap_up = up;
    }

    /// A request between workers `a` and `b` arrives (`on`) or settles: while any does,
    /// their connection stays open however idle (up to a request's lifetime), so that the
    /// peer tables watch what the request depends on. Connections between workers that
    /// share none close at the next tick: nothing depends on their liveness
    /// then (a later message dials again), and a thousand workers would otherwise beat
    /// every peer they ever served, most of the simulator's work at that scale.
    pub fn engage(&self, pairs: impl IntoIterator<Item = (usize, usize)>, on: bool) {
        let mut st = self.lock();
        for (a, b) in pairs {
            for (x, y) in [(a, b), (b, a)] {
                let Some(node) = st.nodes.get_mut(x) else {
                    continue;
                };
                if on {
                    *node.engaged.entry(y).or_insert(0) += 1;
                } else if let Some(n) = node.engaged.get_mut(&y) {
                    *n -= 1;
                    if *n == 0 {
                        node.engaged.remove(&y);
                    }
                }
            }
        }
    }

    /// True when every prefill worker that is up has registered.
    pub fn all_registered(&self) -> bool {
        let st = self.lock();
        let held: BTreeSet<(EngineId, Rank, u64)> = st
            .registry
            .status()
            .engines
            .into_iter()
            .flat_map(|e| {
                let engine = e.engine_id;
                e.workers
                    .into_iter()
                    .map(move |w| (engine.clone(), w.rank, w.incarnation))
            })
            .collect();
        st.ranks.iter().zip(&st.nodes).all(|(rank, n)| {
            n.role != Role::Prefill
                || !n.up
                || held.contains(&(rank.engine_id.clone(), rank.rank(), u64::from(n.inc)))
        })
    }

    /// Starts partition `id` cutting `group` off (only its outgoing side if `one_way`) for
    /// `for_ms`. A cut of the control plane stops heartbeats too: the peer tables on either
    /// side lose the peers they stop hearing for longer than the loss timeout.
    pub fn partition(
        &self,
        id: u64,
        group: BTreeSet<usize>,
        (one_way, plane): (bool, Plane),
        for_ms: u64,
    ) {
        let mut st = self.lock();
        let now = self.now_ms();
        st.partitions.insert(
            id,
            Partition {
                group,
                one_way,
                plane,
            },
        );
        self.push(&mut st, now + for_ms, NetEvent::Heal { partition: id });
    }

    /// Freezes `worker` for `for_ms` (as by SIGSTOP): partition `id` cuts it off from
    /// everyone, on both planes, and the transfers it starts meanwhile are held until it
    /// resumes, then posted (a write only if its lease still holds). Transfers it posted
    /// before go on, as posted RDMA operations complete while their process is stopped.
    pub fn freeze(&self, id: u64, worker: usize, for_ms: u64) {
        self.partition(id, [worker].into(), (false, Plane::Both), for_ms);
        let mut st = self.lock();
        let at = self.now_ms() + for_ms;
        st.frozen.insert(worker, at);
        st.stop_in_gap.insert(worker);
        self.push(&mut st, at, NetEvent::Thaw { worker, at });
    }

    /// Ends every partition and freeze (liveness phase). The peer tables go on deciding:
    /// what they had stopped hearing is lost within [`SimNet::settle_ms`].
    pub fn heal_all(&self) {
        let mut st = self.lock();
        st.partitions.clear();
        st.frozen.clear();
        st.stop_in_gap.clear();
        st.bootstrap_up = true;
        // The frozen workers resume now: what they held back is posted now.
        let now = self.now_ms();
        let held = st
            .agenda
            .take_after(now, |e| matches!(e, NetEvent::Post(_)));
        for event in held {
            self.push(&mut st, now, event);
        }
    }

    /// How long after [`SimNet::heal_all`] every peer table has decided about what it
    /// stopped hearing during the faults: a peer silent since before the heal is lost by a
    /// tick within one loss timeout and an interval; the other end, which then stops
    /// hearing it, within another; plus a hop; and a rank lost during the faults whose
    /// process was only frozen may be refused to new requests as long as its lost mark is
    /// kept ([`Timing::lost_kept_ms`]), unless it is heard again first.
    pub fn settle_ms(&self) -> u64 {
        let st = self.lock();
        let t = &st.timing;
        2 * (t.loss_timeout_ms() + t.heartbeat_interval_ms()) + t.delay_ms.1 + t.lost_kept_ms()
    }

    /// Counters so far.
    pub fn stats(&self) -> NetStats {
        self.lock().stats.clone()
    }

    /// The hash of every delivery and landing so far.
    pub fn hash(&self) -> u64 {
        self.lock().hash.finish()
    }

    /// Takes the trace lines and findings gathered since the last call.
    pub fn take_notes(&self) -> (Vec<NetNote>, Vec<NetFinding>) {
        let mut st = self.lock();
        (
            std::mem::take(&mut st.notes),
            std::mem::take(&mut st.findings),
        )
    }

    fn push(&self, st: &mut NetState, at: u64, event: NetEvent) {
        st.agenda.push(at, event);
        if at < st.wake_at {
            st.wake_at = at;
            self.notify.notify_one();
        }
    }

    /// Worker `who`'s bootstrap client at its tick `t` (a prefill's, once registered): when
    /// its beat is due, a beat on an open connection refreshes its record at the server
    /// (one the server cannot be reached for breaks the connection); without a connection
    /// it reconnects and registers again, as the real client does on its next beat.
    fn bootstrap_beat(&self, st: &mut NetState, t: u64, who: (usize, u32)) {
        let up = st.bootstrap_up;
        let every = st.timing.bootstrap_heartbeat_ms();
        let Some(node) = st.node_mut(who.0).filter(|n| n.inc == who.1 && n.up) else {
            return;
        };
        let open = node.boot.open;
        if node.role != Role::Prefill || node.boot.registering || t < node.boot.beat_due {
            return;
        }
        // A beat the server cannot be reached for breaks the connection; without one the
        // client registers again.
        node.boot = BootConn {
            open: open && up,
            registering: !open,
            beat_due: t + every,
        };
        if open {
            if up {
                let now = st.at(t);
                st.registry.touch(boot_conn(who), now);
            }
            return;
        }
        st.stats.registered_again += 1;
        st.note(
            t,
            None,
            format!("w{} reconnects to the bootstrap server", who.0),
        );
        let at = t + st.timing.delay_ms.0;
        self.push(
            st,
            at,
            NetEvent::Register {
                who,
                backoff_ms: REGISTER_BACKOFF_MS_MIN,
            },
        );
    }

    /// Runs every event due at or before `now_ms`, in order.
    pub fn run_due(&self, now_ms: u64) {
        let mut st = self.lock();
        while let Some((t, event)) = st.agenda.pop_due(now_ms) {
            self.run_event(&mut st, t, event);
        }
    }

    fn run_event(&self, st: &mut NetState, t: u64, event: NetEvent) {
        match event {
            NetEvent::Deliver(d) => {
                let Delivery {
                    from,
                    from_inc,
                    to,
                    to_inc,
                    id,
                    msg,
                    losses,
                } = *d;
                st.deliver(t, (from, from_inc), (to, to_inc), id, (msg, losses))
            }
            NetEvent::Land(landing) => {
                let Landing {
                    src,
                    dst,
                    src_blocks,
                    dst_blocks,
                    id,
                    write,
                    leased,
                    reply,
                } = *landing;
                let ends = Ends {
                    src,
                    dst,
                    src_blocks: &src_blocks,
                    dst_blocks: &dst_blocks,
                };
                let r = st.land(t, ends, &id, write);
                match (r, leased) {
                    (Ok(()), Some(leased)) => self.seen(st, t, leased, reply),
                    (r, _) => {
                        let _ = reply.send(r);
                    }
                }
            }
            NetEvent::Seen { leased, reply } => self.seen(st, t, leased, reply),
            NetEvent::Expire { req, reply } => {
                st.stats.transfers_failed += 1;
                st.note(
                    t,
                    req,
                    "transfer ended at its deadline, nothing landed".into(),
                );
                let _ = reply.send(Err("the transfer's deadline passed".into()));
            }
            NetEvent::Query {
                who,
                prefill,
                dp,
                lost,
                reply,
            } => {
                let answer = st.answer(t, who, &prefill, dp, lost);
                let _ = reply.send(answer);
            }
            NetEvent::Register { who, backoff_ms } => {
                if let Some(retry) = st.register(t, who, backoff_ms) {
                    let next = (backoff_ms * 2).min(REGISTER_BACKOFF_MS_MAX);
                    self.push(
                        st,
                        t + retry,
                        NetEvent::Register {
                            who,
                            backoff_ms: next,
                        },
                    );
                }
            }
            NetEvent::Sweep => {
                let next = t + st.sweep_ms;
                self.push(st, next, NetEvent::Sweep);
                st.sweep(t);
            }
            NetEvent::Tick { worker, inc } => {
                if !st.alive((worker, inc)) {
                    return; // the incarnation's control loop is gone
                }
                let next = t + st.timing.heartbeat_interval_ms();
                self.push(st, next, NetEvent::Tick { worker, inc });
                // A frozen worker's tick waits for it to resume (`Thaw`).
                if st.frozen.get(&worker).is_none_or(|until| *until <= t) {
                    self.bootstrap_beat(st, t, (worker, inc));
                    if let Some((at, beats)) = st.tick(t, worker) {
                        self.push(st, at, beats);
                    }
                }
            }
            NetEvent::Beats { from, beats } => st.hear_beats(t, from, beats),
            NetEvent::Heal { partition } => {
                if st.partitions.remove(&partition).is_some() {
                    st.note(t, None, format!("partition {partition} healed"));
                }
            }
            NetEvent::Thaw { worker, at } => {
                if st.frozen.get(&worker) == Some(&at) {
                    st.frozen.remove(&worker);
                    st.stop_in_gap.remove(&worker);
                    st.note(t, None, format!("w{worker} resumes"));
                    // The tick it missed runs at once, before anything reaches it.
                    if let Some(inc) = st.node_at(worker).map(|n| n.inc) {
                        self.bootstrap_beat(st, t, (worker, inc));
                    }
                    if let Some((at, beats)) = st.tick(t, worker) {
                        self.push(st, at, beats);
                    }
                }
            }
            NetEvent::Post(post) => self.post(st, t, *post),
        }
    }
}

/// The bootstrap connection of worker incarnation `who`: one per incarnation, as a real
/// client opens.
fn boot_conn((idx, inc): (usize, u32)) -> ConnId {
    ConnId(((idx as u64) << 32) | u64::from(inc))
}

/// A worker's peer table, with the control loop's loss timeout.
fn peer_table(timing: &Timing) -> PeerTable<usize> {
    PeerTable::new(Duration::from_millis(timing.loss_timeout_ms()))
}

/// A worker's directory's lost marks, kept [`Timing::lost_kept_ms`].
fn lost_ranks(timing: &Timing) -> LostRanks {
    LostRanks::new(Duration::from_millis(timing.lost_kept_ms()))
}

impl NetState {
    fn note(&mut self, t_ms: u64, req: Option<u64>, text: String) {
        self.notes.push(NetNote { t_ms, req, text });
    }

    fn node_of(&self, rank: &RankInfo) -> Option<&Node> {
        self.index.get(rank).and_then(|i| self.nodes.get(*i))
    }

    fn node_at(&self, idx: usize) -> Option<&Node> {
        self.nodes.get(idx)
    }

    /// Whether workers `a` and `b` run on one host.
    fn same_host(&self, a: usize, b: usize) -> bool {
        self.shape.same_host(a, b)
    }

    /// Blocks in worker `idx`'s pool (0 before its memory is set).
    fn pool_blocks(&self, idx: usize) -> u32 {
        self.node_at(idx)
            .and_then(|n| n.region.as_ref())
            .map_or(0, |r| r.layout().blocks)
    }

    fn alive(&self, (idx, inc): (usize, u32)) -> bool {
        self.node_at(idx).is_some_and(|n| n.up && n.inc == inc)
    }

    /// Whether a partition cuts `from` → `to` on the control plane (`control`) or the
    /// data plane.
    fn partitioned(&self, control: bool, from: usize, to: usize) -> bool {
        self.partitions.values().any(|p| {
            let plane = if control {
                p.plane.cuts_control()
            } else {
                p.plane.cuts_data()
            };
            plane && p.blocks(from, to)
        })
    }

    /// Loss declarations between `a` and `b`, either way, so far.
    fn losses_between(&self, a: usize, b: usize) -> u64 {
        let count = |k| self.losses.get(&k).copied().unwrap_or(0);
        count((a, b)) + count((b, a))
    }

    /// Whether a one-sided writer's lease still holds: no loss declared between it and
    /// the target since the target granted the blocks.
    fn lease_holds(&self, leased: Leased) -> bool {
        self.losses_between(leased.by, leased.peer) == leased.losses
    }

    fn deliver(
        &mut self,
        t: u64,
        from: (usize, u32),
        to: (usize, u32),
        id: RequestId,
        (msg, losses): (PeerMessage, u64),
    ) {
        // The request's index only for a note (parsed only when one is written).
        if !self.alive(from) || !self.alive(to) {
            self.stats.dead_end += 1;
            let text = format!(
                "drop w{}->w{} {:?}: an end restarted",
                from.0,
                to.0,
                MessageKind::of(&msg)
            );
            return self.note(t, req_index(&id), text);
        }
        if self.partitioned(true, from.0, to.0) {
            self.stats.partitioned += 1;
            let text = format!(
                "drop w{}->w{} {:?}: partitioned",
                from.0,
                to.0,
                MessageKind::of(&msg)
            );
            return self.note(t, req_index(&id), text);
        }
        if !self.hear(t, to.0, from, true) {
            let text = format!(
                "drop w{}->w{} {:?}: stale incarnation {}",
                from.0,
                to.0,
                MessageKind::of(&msg),
                from.1
            );
            return self.note(t, req_index(&id), text);
        }
        self.hash.word(t);
        self.hash.word(from.0 as u64);
        self.hash.word(to.0 as u64);
        self.hash.str(id.as_str());
        self.hash.word(MessageKind::of(&msg) as u64);
        let from_rank = self.ranks[from.0].clone();
        let Some(inbox) = self.node_at(to.0).and_then(|n| n.inbox.clone()) else {
            return;
        };
        let named = match &msg {
            // The receiver is the source of a transfer info's request, the destination
            // of a `Ready`'s.
            PeerMessage::TransferInfo { blocks, .. } => Some((blocks, true)),
            PeerMessage::Ready { blocks, .. } => Some((blocks, false)),
            _ => None,
        };
        if let Some((blocks, we_send)) = named {
            // The control loop's own check on arrival, before a byte moves.
            let layout = |w: usize| self.node_at(w).and_then(|n| n.region.clone());
            if let (Some(mine), theirs) = (layout(to.0), layout(from.0)) {
                let me = &self.ranks[to.0];
                let theirs = theirs.as_ref().map(|r| r.layout());
                let checked = handoff_net::check_named_blocks(
                    me,
                    mine.layout(),
                    &from_rank,
                    theirs,
                    blocks,
                    we_send,
                );
                if let Err(why) = checked {
                    self.stats.refused += 1;
                    let text = format!("refuse w{}->w{}: {why}", from.0, to.0);
                    self.note(t, req_index(&id), text);
                    if inbox.deliver_invalid(from_rank, id, why) {
                        self.stats.delivered += 1;
                    }
                    return;
                }
            }
            let grant = Grant { node: from, losses };
            if let Some(node) = self.nodes.get_mut(to.0) {
                let grants = node.rkeys.entry(id.clone()).or_default();
                match grants.iter_mut().find(|(by, _)| *by == from.0) {
                    Some(held) => held.1 = grant,
                    None => grants.push((from.0, grant)),
                }
            }
        }
        if inbox.deliver(from_rank, id, msg) {
            self.stats.delivered += 1;
        }
    }

    fn land(&mut self, t: u64, ends: Ends<'_>, id: &RequestId, write: bool) -> Result<(), String> {
        let Ends {
            src,
            dst,
            src_blocks,
            dst_blocks,
        } = ends;
        let fail = |st: &mut Self, why: String| {
            st.stats.transfers_failed += 1;
            st.note(
                t,
                req_index(id),
                format!("transfer w{}->w{} failed: {why}", src.0, dst.0),
            );
            Err(why)
        };
        if !self.alive(src) || !self.alive(dst) {
            return fail(self, "an end of the transfer is gone".into());
        }
        if self.partitioned(false, src.0, dst.0) || self.partitioned(false, dst.0, src.0) {
            return fail(self, "the data path is partitioned".into());
        }
        let (Some(s), Some(d)) = (self.node_at(src.0), self.node_at(dst.0)) else {
            return fail(self, "no such worker".into());
        };
        let (Some(sr), Some(dr), Some(sp), Some(dp)) = (
            s.region.clone(),
            d.region.clone(),
            s.pool.clone(),
            d.pool.clone(),
        ) else {
            return fail(self, "worker has no memory".into());
        };
        // The fenced plane checks the transfer where it lands, against the runtime's own
        // grant table: a push against decode's write grant on its blocks, a pull against
        // prefill's read grant on its blocks (revoked when the request ended there).
        let (target, asker, access, granted) = if write {
            (&d.grants, &self.ranks[src.0], Access::Write, dst_blocks)
        } else {
            (&s.grants, &self.ranks[dst.0], Access::Read, src_blocks)
        };
        let checked = (self.data_plane == DataPlane::Fenced)
            .then(|| target.check_and_copy(asker, id, access, granted, &mut || {}));
        if let Some(Err(why)) = checked {
            self.stats.fenced += 1;
            return fail(self, format!("{why} (fenced)"));
        }
        // Both ends must still hold the request's own blocks, whatever became of the
        // worker that posted it (a write posted by a frozen writer as it resumed may be
        // for a request that ended there, its blocks since reused by another).
        let dst_ok = dp
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .owns_all(dst_blocks, id);
        let src_ok = sp
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .owns_all(src_blocks, id);
        if !dst_ok {
            self.findings.push(NetFinding {
                t_ms: t,
                req: req_index(id),
                detail: format!(
                    "a transfer for {id} landed in w{} blocks {dst_blocks:?} that its engine had taken back (use after release)",
                    dst.0
                ),
            });
        }
        if !src_ok {
            self.stats.stale_source += 1;
            self.note(
                t,
                req_index(id),
                format!(
                    "transfer w{}->w{} read source blocks no longer owned by {id}",
                    src.0, dst.0
                ),
            );
        }
        // Between pipeline ranks only the layers both hold move; between TP sizes, the
        // heads the destination takes from the source.
        let slices = BlockSlice::spans_for_ranks(
            &self.ranks[src.0],
            sr.layout(),
            &self.ranks[dst.0],
            dr.layout(),
        );
        let copied = slices.and_then(|slices| {
            slices.into_iter().try_for_each(|slice| {
                Region::copy_block_slices(&sr, src_blocks, &dr, dst_blocks, slice)
            })
        });
        match copied {
            Ok(()) => {
                self.stats.transfers_ok += 1;
                self.hash.word(t);
                self.hash.word(src.0 as u64);
                self.hash.word(dst.0 as u64);
                Ok(())
            }
            Err(e) => fail(self, e.to_string()),
        }
    }

    fn answer(
        &mut self,
        t: u64,
        who: (usize, u32),
        prefill: &EngineId,
        dp: Option<u32>,
        lost: bool,
    ) -> Result<Vec<Peer>, ResolveError> {
        self.stats.queries += 1;
        let failed = |st: &mut Self, detail: String| {
            st.stats.queries_failed += 1;
            Err(ResolveError::NotReady { detail })
        };
        if lost {
            return failed(self, "bootstrap query timed out".into());
        }
        if !self.bootstrap_up {
            return failed(
                self,
                format!("bootstrap server {BOOTSTRAP_ADDRESS} is down"),
            );
        }
        if self.faults_on && self.rng.chance(self.faults.query_error_ppm) {
            self.stats.queries_failed += 1;
            return Err(ResolveError::Fatal(FailureReason::BootstrapUnavailable {
                address: BOOTSTRAP_ADDRESS.into(),
                last_error: "query answered with an error (injected)".into(),
            }));
        }
        let me = self.ranks[who.0].clone();
        // The real registry's answer, and the runtime's own choice of prefill ranks from
        // it, as the real bootstrap client makes it.
        let workers = match self.registry.query(prefill) {
            QueryAnswer::Ready { workers } => workers,
            QueryAnswer::NotReady {
                registered,
                expected,
            } => {
                let detail = format!(
                    "engine {prefill}: {} of {expected} ranks registered",
                    registered.len()
                );
                return failed(self, detail);
            }
            QueryAnswer::UnknownEngine => {
                return failed(self, format!("engine {prefill} unknown"));
            }
        };
        // The client's own check: a worker it lost is not handed out for a new request.
        let now = self.at(t);
        if let Some(node) = self.nodes.get(who.0) {
            if let Err(e) = node.lost.check(BOOTSTRAP_ADDRESS, &workers, now) {
                self.stats.queries_refused_lost += 1;
                return Err(ResolveError::Fatal(e.failure_reason()));
            }
        }
        let ranks = workers.iter().map(|w| (&w.rank, w.role));
        match select_prefill_peers(&me, prefill, dp, ranks) {
            Err(ResolveError::NotReady { detail }) => failed(self, detail),
            other => other,
        }
    }

    /// One registration attempt; `Some(wait)` to try again after `wait` ms.
    fn register(&mut self, t: u64, who: (usize, u32), backoff_ms: u64) -> Option<u64> {
        if !self.alive(who) {
            return None;
        }
        let lost = self.faults_on && self.rng.chance(self.faults.loss_ppm);
        if !self.bootstrap_up || lost {
            self.stats.registrations_retried += 1;
            let why = if lost { "lost" } else { "server down" };
            self.note(
                t,
                None,
                format!(
                    "w{} registration failed ({why}); retry in {backoff_ms} ms",
                    who.0
                ),
            );
            return Some(backoff_ms);
        }
        let rank = self.ranks[who.0].clone();
        let role = self.node_at(who.0).map(|n| n.role)?;
        let record = WorkerRecord {
            rank,
            role,
            incarnation: u64::from(who.1),
            control_address: format!("sim://w{}/control", who.0),
            data_address: format!("sim://w{}/data", who.0),
            data_descriptor: Vec::new(),
        };
        // One connection per worker incarnation, as a real client opens.
        let origin = Origin {
            conn: boot_conn(who),
            peer: std::net::SocketAddr::from(([10, 0, 0, 1], 7400)),
        };
        let now = self.at(t);
        let beat_due = t + self.timing.bootstrap_heartbeat_ms();
        let outcome = self.registry.register(record, origin, now);
        let registered = matches!(
            outcome,
            RegisterOutcome::Added | RegisterOutcome::Refreshed | RegisterOutcome::Replaced { .. }
        );
        if let Some(n) = self.node_mut(who.0) {
            // Refused for good, as the real client takes a conflict: no beat registers again.
            n.boot = BootConn {
                open: registered,
                registering: false,
                beat_due: if registered { beat_due } else { u64::MAX },
            };
        }
        match outcome {
            // Idempotent: the same rank registering again (a restart) replaces itself.
            RegisterOutcome::Added
            | RegisterOutcome::Refreshed
            | RegisterOutcome::Replaced { .. } => {
                self.note(t, None, format!("w{} registered", who.0));
            }
            RegisterOutcome::Conflict(held) => {
                let text = format!(
                    "w{} registration refused: the server holds incarnation {}",
                    who.0, held.incarnation
                );
                self.note(t, None, text);
            }
            RegisterOutcome::Refused(why) => {
                self.note(t, None, format!("w{} registration refused: {why}", who.0));
            }
        }
        None
    }

    /// The server's expiry sweep at `t`, while it runs (the registry's own rule: records
    /// not heard from for [`Timing::expire_after_ms`]): each expired record's connection is
    /// closed, and its worker's client, if it still runs, registers again at its next beat.
    fn sweep(&mut self, t: u64) {
        if !self.bootstrap_up {
            return;
        }
        let now = self.at(t);
        let after = Duration::from_millis(self.timing.expire_after_ms());
        for expired in self.registry.expire(now, after) {
            self.stats.records_expired += 1;
            let idx = self.index.get(&expired.record.rank).copied();
            let silent = expired.silent.as_millis();
            let text = match idx {
                Some(i) => format!(
                    "record of w{i}.{} expired (silent {silent} ms)",
                    expired.record.incarnation
                ),
                None => format!("record of {} expired", expired.record.rank),
            };
            self.note(t, None, text);
            let Some(node) = idx.and_then(|i| self.node_mut(i)) else {
                continue;
            };
            if u64::from(node.inc) == expired.record.incarnation {
                node.boot.open = false;
            }
        }
    }

    // ---- liveness: the control loop's peer table, fed in virtual time ----

    /// The instant the peer tables see at virtual `t` ms.
    fn at(&self, t: u64) -> Instant {
        self.epoch + Duration::from_millis(t)
    }

    fn node_mut(&mut self, idx: usize) -> Option<&mut Node> {
        self.nodes.get_mut(idx)
    }

    /// What worker `worker`'s control loop does on its heartbeat tick at `t`: lose the
    /// connected peers its table says are silent, then beat every connected peer. Returns
    /// the beats' arrival. Also closes its connections idle for longer than a request
    /// lives (the simulator's economy; no request waits on them, so nobody is told).
    fn tick(&mut self, t: u64, worker: usize) -> Option<(u64, NetEvent)> {
        let now = self.at(t);
        let mut idle = std::mem::take(&mut self.idle_scratch);
        let node = self.node_at(worker).filter(|n| n.up)?;
        let inc = node.inc;
        // Filtered in place: usually empty, and no second list when not.
        let mut silent = node.table.silent(now);
        silent.retain(|p| node.conns.contains_key(p));
        // (peer, closed only because no live request is shared)
        idle.extend(node.conns.iter().filter_map(|(p, c)| {
            let idle = t.saturating_sub(c.last);
            if idle > self.idle_ms {
                Some((*p, false))
            } else {
                // One between workers that share no live request closes at once (unless
                // it carried a message this very millisecond): nothing depends on its
                // liveness. Kept for a heartbeat interval, it beat 3.4 times as often
                // as needed in the scale run (2.5 beats a request against 0.74).
                let free = idle > 0 && !node.engaged.contains_key(p);
                free.then_some((*p, true))
            }
        }));
        let timeout = node.table.loss_timeout();
        for peer in silent {
            self.lose(t, worker, peer, &format!("no heartbeat for {timeout:?}"));
        }
        for &(peer, unengaged) in &idle {
            let closed = self.close(worker, peer);
            self.stats.closed_unengaged += u64::from(unengaged && closed);
        }
        idle.clear();
        self.idle_scratch = idle;
        let mut beats = self.spare_beats.pop().unwrap_or_default();
        let node = self.nodes.get_mut(worker)?;
        for (&to, conn) in &node.conns {
            let (seq, echo) = node.table.beat(&to, now);
            beats.push(Beat {
                to,
                to_inc: conn.inc,
                conn: conn.id,
                seq,
                echo,
            });
        }
        if beats.is_empty() {
            self.spare_beats.push(beats);
            return None;
        }
        self.stats.heartbeats += beats.len() as u64;
        let arrives = t + self.delay();
        let event = NetEvent::Beats {
            from: (worker, inc),
            beats,
        };
        Some((arrives, event))
    }

    /// One tick's heartbeats arrive: each is heard by its receiver, if the connection's two
    /// ends are still the incarnations it joined and no partition cuts the control plane
    /// between them. (Not answered: see the module docs.)
    fn hear_beats(&mut self, t: u64, from: (usize, u32), mut beats: Vec<Beat>) {
        if self.alive(from) {
            self.hear_each(t, from, &beats);
        }
        // The list goes back for a later tick to fill.
        beats.clear();
        if self.spare_beats.len() < SPARE_BEAT_LISTS_MAX {
            self.spare_beats.push(beats);
        }
    }

    fn hear_each(&mut self, t: u64, from: (usize, u32), beats: &[Beat]) {
        let lease_for = Duration::from_millis(self.timing.loss_timeout_ms());
        for beat in beats {
            if !self.alive((beat.to, beat.to_inc)) || self.partitioned(true, from.0, beat.to) {
                continue;
            }
            if self.closed_both_ends(from.0, beat) {
                continue;
            }
            if !self.hear(t, beat.to, from, false) {
                continue;
            }
            self.stats.heartbeats_heard += 1;
            if let Some(node) = self.nodes.get_mut(beat.to) {
                let _answer = node
                    .table
                    .heartbeat(&from.0, beat.seq, beat.echo, lease_for);
            }
        }
    }

    /// A beat from `from` that arrives after both ends of its connection closed (`close`:
    /// idle) is gone with it; it does not open a connection again. (One the receiver
    /// still holds is heard, and so is one whose sender still holds the end it left from:
    /// a peer that lost the sender hears it, as a real end reads what arrived before the
    /// other's close.)
    fn closed_both_ends(&self, from: usize, beat: &Beat) -> bool {
        let held = |x: usize, y: usize| self.node_at(x).and_then(|n| n.conns.get(&y));
        held(beat.to, from).is_none() && held(from, beat.to).is_none_or(|c| c.id != beat.conn)
    }

    /// Worker `at` receives a message (a request's, if `request`) or a heartbeat from
    /// `from`, as its control loop does: a message of a peer it holds no connection with,
    /// or of a newer incarnation, comes with that connection's hello (the incarnation is
    /// noted, a restarted peer lost first); one of an incarnation its table no longer holds
    /// is stale. False: dropped as stale.
    fn hear(&mut self, t: u64, at: usize, from: (usize, u32), request: bool) -> bool {
        let inc = u64::from(from.1);
        let Some(node) = self.node_at(at) else {
            return false;
        };
        // On a connection with this very incarnation (the table adopted it): current.
        if node.conns.get(&from.0).map(|c| c.inc) != Some(from.1) {
            let known = node.table.known_incarnation(&from.0);
            if known.is_none_or(|k| k <= inc) {
                self.connect(t, at, from.0, inc);
            }
            let Some(node) = self.node_at(at) else {
                return false;
            };
            if !node.table.current(&from.0, inc) {
                self.stats.stale += 1;
                return false;
            }
        }
        let now = self.at(t);
        let Some(node) = self.nodes.get_mut(at) else {
            return false;
        };
        node.table.heard(&from.0, now);
        if request {
            if let Some(conn) = node.conns.get_mut(&from.0) {
                conn.last = t;
            }
        }
        true
    }

    /// Worker `at` connects with incarnation `inc` of `peer` (a hello, or the answer to
    /// its own): `PeerTable::incarnation` and `adopt` (a `Restarted` peer is lost first),
    /// then `connected`, as `on_hello` does.
    fn connect(&mut self, t: u64, at: usize, peer: usize, inc: u64) {
        let Some(node) = self.node_at(at) else {
            return;
        };
        let replaced = match node.table.incarnation(&peer, inc) {
            Incarnation::Unchanged if node.table.is_lost(&peer) => {
                // The very process it lost answers (it was frozen): new requests may pair
                // with it again, as `control.rs`'s `note_incarnation` tells the directory.
                if node.lost.found(&self.ranks[peer], inc, self.at(t)) {
                    self.stats.lost_found += 1;
                    let text = format!("w{at}: w{peer} answers again at incarnation {inc}");
                    self.note(t, None, text);
                }
                false
            }
            Incarnation::First | Incarnation::Unchanged => false,
            Incarnation::Back { old } => {
                self.note(t, None, format!("w{at}: w{peer} back ({old} -> {inc})"));
                true
            }
            Incarnation::Restarted { old } => {
                let why = format!("it restarted ({old} -> {inc})");
                self.lose(t, at, peer, &why);
                true
            }
            Incarnation::Stale { current } => {
                let why =
                    format!("w{at}: w{peer} refused (incarnation {inc}, older than {current})");
                self.note(t, None, why);
                return;
            }
        };
        let now = self.at(t);
        self.conns_opened += 1;
        let id = self.conns_opened;
        let Some(node) = self.nodes.get_mut(at) else {
            return;
        };
        node.table.adopt(&peer, inc);
        node.table.connected(&peer, now, Arc::new(Lease::new()));
        if replaced {
            if let Some(inbox) = node.inbox.clone() {
                inbox.peer_replaced(self.ranks[peer].clone());
            }
        }
        let inc = u32::try_from(inc).unwrap_or(u32::MAX);
        node.conns.insert(peer, Conn { id, inc, last: t });
    }

    /// Worker `at` sends a request's message to `peer` (incarnation `inc` now): over its
    /// connection, or a new one it dials. The dial's answer would announce `inc`; the
    /// simulator adopts it at once (an unreachable peer is then lost by the table's
    /// timeout, as a dial that gets no answer is).
    fn dial(&mut self, t: u64, at: usize, (peer, inc): (usize, u32)) {
        let Some(node) = self.node_mut(at) else {
            return;
        };
        match node.conns.get_mut(&peer) {
            Some(conn) => conn.last = t,
            None => self.connect(t, at, peer, u64::from(inc)),
        }
    }

    /// Worker `observer` loses `peer`, as the control loop's `lose` does: the table forgets
    /// it (its incarnation kept, marked lost), the connection closes, and every request of
    /// the runtime that depends on it fails (`Inbox::peer_lost`). Counted as a loss
    /// declared between the two (the grants' leases).
    fn lose(&mut self, t: u64, observer: usize, peer: usize, why: &str) {
        let at = self.at(t);
        let Some(node) = self.nodes.get_mut(observer).filter(|n| n.up) else {
            return;
        };
        let incarnation = node.table.known_incarnation(&peer);
        let known = node.table.lose(&peer);
        let connected = node.conns.remove(&peer).is_some();
        if !known && !connected {
            return;
        }
        let inbox = node.inbox.clone();
        if let Some(i) = incarnation {
            node.lost.insert(&self.ranks[peer], i, at);
        }
        if let Some(inc) = incarnation.and_then(|i| u32::try_from(i).ok()) {
            self.lost_incarnation.insert((observer, peer), inc);
        }
        *self.losses.entry((observer, peer)).or_insert(0) += 1;
        self.stats.peer_lost += 1;
        self.note(t, None, format!("w{observer} loses w{peer}: {why}"));
        if let Some(inbox) = inbox {
            inbox.peer_lost(self.ranks[peer].clone());
        }
    }

    /// The connection between `a` and `b` closes on both ends, quietly: idle for longer
    /// than any request lives, or for a heartbeat interval with no live request between the two,
    /// nothing depends on it (only its incarnation is kept, as for a lost peer; the next
    /// message opens a new one).
    /// True when `a` still held the connection (not lost just before).
    fn close(&mut self, a: usize, b: usize) -> bool {
        let mut held = false;
        for (x, y) in [(a, b), (b, a)] {
            if let Some(node) = self.node_mut(x) {
                if node.conns.remove(&y).is_some() {
                    node.table.lose(&y);
                    held |= x == a;
                }
            }
        }
        held
    }

    fn delay(&mut self) -> u64 {
        let (lo, hi) = self.timing.delay_ms;
        let mut d = self.rng.range(lo, hi);
        if self.faults_on {
            d += self.rng.range(0, self.faults.jitter_ms);
            if self.rng.chance(self.faults.spike_ppm) {
                self.stats.spiked += 1;
                d += self
                    .rng
                    .range(self.faults.spike_ms.0, self.faults.spike_ms.1);
            }
        }
        d
    }
}

/// Attaches runtimes to a [`SimNet`].
pub struct SimAttach(pub Arc<SimNet>);

impl Attach for SimAttach {
    fn attach(
        &self,
        rank: RankInfo,
        role: Role,
        inbox: Inbox,
        region: Arc<Region>,
    ) -> Result<Arc<dyn Link>, ActorError> {
        let net = &self.0;
        let mut st = net.lock();
        let now = net.now_ms();
        let table = peer_table(&st.timing);
        let lost = lost_ranks(&st.timing);
        let Some(node) = st
            .index
            .get(&rank)
            .copied()
            .and_then(|i| st.nodes.get_mut(i))
        else {
            return Err(ActorError::Config(format!(
                "{rank} is not part of the simulated cluster"
            )));
        };
        if node.up {
            return Err(ActorError::AlreadyAttached(rank));
        }
        if node.role != role {
            return Err(ActorError::Config(format!(
                "{rank} is a {} worker",
                node.role
            )));
        }
        let same_region = node
            .region
            .as_ref()
            .is_some_and(|r| Arc::ptr_eq(r, &region));
        if !same_region {
            return Err(ActorError::Config(format!(
                "{rank}: region differs from the simulated worker's"
            )));
        }
        node.up = true;
        node.inbox = Some(inbox);
        node.grants = Arc::default();
        // A new process: a new control loop, knowing no peer.
        node.table = table;
        node.lost = lost;
        node.conns.clear();
        // Its client connects and registers (below) before it beats.
        node.boot = BootConn {
            registering: role == Role::Prefill,
            ..BootConn::default()
        };
        let (idx, inc) = (node.idx, node.inc);
        let tick = now + st.timing.heartbeat_interval_ms();
        net.push(&mut st, tick, NetEvent::Tick { worker: idx, inc });
        if role == Role::Prefill {
            let at = now + st.timing.delay_ms.0;
            net.push(
                &mut st,
                at,
                NetEvent::Register {
                    who: (idx, inc),
                    backoff_ms: REGISTER_BACKOFF_MS_MIN,
                },
            );
        }
        Ok(Arc::new(SimLink {
            net: net.clone(),
            me: rank,
            idx,
            inc,
        }))
    }
}

/// One runtime's view of the [`SimNet`].
pub struct SimLink {
    net: Arc<SimNet>,
    me: RankInfo,
    idx: usize,
    inc: u32,
}

impl SimLink {
    fn transfer(
        &self,
        id: &RequestId,
        src_node: &Peer,
        dst_node: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: Instant,
    ) -> TransferFuture {
        let net = &self.net;
        let (tx, rx) = oneshot::channel();
        let deadline_ms = deadline
            .saturating_duration_since(net.start.into_std())
            .as_millis() as u64;
        {
            let mut guard = net.lock();
            let st = &mut *guard;
            let now = net.now_ms();
            let (src_idx, dst_idx) = (st.index.get(src_node), st.index.get(dst_node));
            let (src_idx, dst_idx) = (src_idx.copied(), dst_idx.copied());
            // This worker is the source (ranks and indices match one to one).
            let from_me = src_idx == Some(self.idx);
            let post = Post {
                by: self.idx,
                id: id.clone(),
                src_node: src_node.clone(),
                dst_node: dst_node.clone(),
                src_idx,
                dst_idx,
                src,
                dst,
                deadline_ms,
                grant: (if from_me { dst_idx } else { src_idx }).and_then(|peer| {
                    let grants = st.node_at(self.idx)?.rkeys.get(id)?;
                    grants.iter().find(|(by, _)| *by == peer).map(|g| g.1)
                }),
                checked: false,
                reply: tx,
            };
            match st.frozen.get(&self.idx).copied() {
                // A frozen worker's transfer waits for it to resume.
                Some(until) if until > now => {
                    st.stats.deferred += 1;
                    let mut post = post;
                    if from_me && post.grant.is_some() {
                        post.checked = st.stop_in_gap.remove(&self.idx);
                        st.stats.posted_unchecked += u64::from(post.checked);
                    }
                    net.push(st, until, NetEvent::Post(Box::new(post)));
                }
                _ => net.post(st, now, post),
            }
        }
        Box::pin(async move {
            let outcome = rx
                .await
                .unwrap_or_else(|_| Err("transfer abandoned by the network".into()));
            outcome.map_err(|detail| TransferError::Simulated { detail })
        })
    }
}

impl SimNet {
    /// A leased write that landed, as its writer sees the completion: only once it runs
    /// (a frozen writer sees it as it resumes, after its missed tick), and as done only
    /// while its lease holds, i.e. no loss was declared between it and the target since
    /// the grant. Otherwise the bytes landed but the write fails, as every plane's
    /// `ConfirmedLate` does: the target may have failed the request meanwhile.
    fn seen(
        &self,
        st: &mut NetState,
        t: u64,
        leased: Leased,
        reply: oneshot::Sender<Result<(), String>>,
    ) {
        if let Some(until) = st.frozen.get(&leased.by).copied().filter(|u| *u > t) {
            self.push(st, until, NetEvent::Seen { leased, reply });
            return;
        }
        if st.lease_holds(leased) {
            let _ = reply.send(Ok(()));
            return;
        }
        st.stats.confirmed_late += 1;
        let _ = reply.send(Err(format!(
            "write to w{} completed only after the lease ended (a loss was declared between us since it granted the blocks)",
            leased.peer
        )));
    }

    /// Posts a transfer at `now`: its landing (or its expiry at the deadline) goes on the
    /// agenda, or it is refused at once (an end gone, a one-sided write whose lease ended).
    fn post(&self, st: &mut NetState, now: u64, post: Post) {
        let Post {
            by,
            id,
            src_node,
            dst_node,
            src_idx,
            dst_idx,
            src,
            dst,
            deadline_ms,
            grant,
            checked,
            reply,
        } = post;
        // The worker that starts it writes when it is the source.
        let write = src_idx == Some(by);
        let end = |idx: Option<usize>| idx.and_then(|i| st.node_at(i)).map(|n| (n.idx, n.inc));
        let mut ends = (end(src_idx), end(dst_idx));
        let rdma = st.data_plane == DataPlane::Rdma;
        // On either plane a write seen done only after its lease ended is not done
        // (`Lease::confirm`).
        let leased = grant.filter(|_| write).map(|granted| Leased {
            by,
            peer: granted.node.0,
            losses: granted.losses,
        });
        if let Some(granted) = grant.filter(|_| rdma) {
            // The remote end is the registration this worker learned for the request.
            let peer = granted.node.0;
            if ends.0.is_some_and(|(i, _)| i == peer) {
                ends.0 = Some(granted.node);
            } else if ends.1.is_some_and(|(i, _)| i == peer) {
                ends.1 = Some(granted.node);
            }
        }
        // A one-sided writer fences itself: nothing is posted once a loss was declared
        // between it and the peer since the grant (its lease ended). The fenced plane's
        // target refuses such a write on arrival instead.
        let lease_ended = leased
            .filter(|l| rdma && !checked && !st.lease_holds(*l))
            .map(|l| l.peer);
        let refused = match ends {
            _ if lease_ended.is_some() => {
                st.stats.lease_refused += 1;
                Some(format!(
                    "write lease with w{} ended (a loss was declared between us since it granted the blocks): nothing posted",
                    lease_ended.unwrap_or_default()
                ))
            }
            (Some(s), Some(d)) if st.alive(s) && st.alive(d) => {
                let blocks = src.len() as u64;
                let mut ms = st.timing.transfer_base_ms + blocks / st.timing.blocks_per_ms;
                if st.faults_on && st.rng.chance(st.faults.slow_ppm) {
                    st.stats.transfers_slow += 1;
                    ms *= st
                        .rng
                        .range(st.faults.slow_factor.0, st.faults.slow_factor.1)
                        .max(1);
                }
                let lands = now + ms.max(1);
                // A write checked before its worker stopped was posted then, in effect: it
                // lands whatever its deadline (the plane checked it with the lease).
                let deadline_ms = if checked { u64::MAX } else { deadline_ms };
                let event = if lands > deadline_ms {
                    // The plane's promise (`Link::write`): nothing posted past the
                    // deadline, an answer by it.
                    NetEvent::Expire {
                        req: req_index(&id),
                        reply,
                    }
                } else {
                    NetEvent::Land(Box::new(Landing {
                        src: s,
                        dst: d,
                        src_blocks: src,
                        dst_blocks: dst,
                        id,
                        write,
                        leased,
                        reply,
                    }))
                };
                self.push(st, lands.min(deadline_ms.max(now)), event);
                return;
            }
            _ => Some(format!(
                "transfer {src_node} -> {dst_node}: an end is not attached"
            )),
        };
        if let Some(why) = refused {
            st.stats.transfers_failed += 1;
            let _ = reply.send(Err(why));
        }
    }
}

/// How often a quarantine looks whether a lost writer's incarnation has ended (as the
/// network link polls a pidfd).
const WRITER_EXIT_POLL: std::time::Duration = std::time::Duration::from_millis(250);

impl Link for SimLink {
    fn transport(&self) -> &'static str {
        "sim"
    }

    fn me(&self) -> &RankInfo {
        &self.me
    }

    /// The RDMA-like plane lands writes whatever happened since they were posted, as
    /// one-sided writes do; the fenced plane refuses late ones on arrival, as TCP does.
    fn one_sided(&self) -> bool {
        self.net.lock().data_plane == DataPlane::Rdma
    }

    /// The peers on another host (`Shape::hosts`), which this worker cannot watch (below).
    fn unwatched(&self, peers: &[Peer]) -> handoff_actors::link::UnwatchedFuture {
        let mut st = self.net.lock();
        let unwatched: Vec<Peer> = peers
            .iter()
            .filter(|p| {
                st.node_of(p)
                    .is_some_and(|n| !st.same_host(n.idx, self.idx))
            })
            .cloned()
            .collect();
        if !unwatched.is_empty() {
            st.stats.pulls_instead += 1;
        }
        Box::pin(async move { unwatched })
    }

    /// A worker on another host (`Shape::hosts`) cannot be watched: `None`, as for a real
    /// peer the kernel cannot verify. Every other is watched as a verified same-host process is: its
    /// incarnation's end (a crash) is seen, a stop is not. The incarnation watched is the
    /// one this worker knows for the rank (the one that may still write), or (`replaced`:
    /// this worker heard a newer one since the request lost it) the one before it; never
    /// one that took its place since (which never wrote for the request, and may live on).
    /// Without a known one, the one this worker last lost.
    fn writer_exit(&self, peer: &Peer, replaced: bool) -> Option<handoff_actors::link::ExitFuture> {
        let node = {
            let st = self.net.lock();
            let n = st.node_of(peer)?;
            if !st.same_host(n.idx, self.idx) {
                return None;
            }
            let known = st
                .node_at(self.idx)
                .and_then(|me| me.table.known_incarnation(&n.idx))
                .and_then(|i| u32::try_from(i).ok());
            let lost = st.lost_incarnation.get(&(self.idx, n.idx)).copied();
            let inc = known.or(lost).unwrap_or(n.inc);
            // (A simulated worker has one incarnation at a time: any earlier one is over.)
            (n.idx, if replaced { inc.saturating_sub(1) } else { inc })
        };
        let net = self.net.clone();
        Some(Box::pin(async move {
            while net.lock().alive(node) {
                tokio::time::sleep(WRITER_EXIT_POLL).await;
            }
        }))
    }

    fn send(&self, to: &Peer, id: &RequestId, msg: PeerMessage) -> Result<(), LinkError> {
        let net = &self.net;
        let mut guard = net.lock();
        let st = &mut *guard;
        // Grant before the message leaves, as the network link does.
        let grant = match &msg {
            PeerMessage::TransferInfo { blocks, .. } => Some((Access::Write, blocks)),
            PeerMessage::Ready { blocks, .. } => Some((Access::Read, blocks)),
            _ => None,
        };
        if let (Some((access, blocks)), Some(node)) = (grant, st.node_at(self.idx)) {
            if node.inc == self.inc {
                node.grants.grant(to, id, access, blocks);
            }
        }
        let now = net.now_ms();
        st.stats.sent += 1;
        let Some(dest) = st.node_of(to).map(|n| (n.idx, n.inc)) else {
            return Err(LinkError::PeerGone(to.to_string()));
        };
        // Over its connection with the peer, or a new one (a frozen worker does nothing
        // until it resumes: what it sends meanwhile is cut off with it).
        let frozen = st.frozen.get(&self.idx).is_some_and(|until| *until > now);
        if !frozen && st.alive((self.idx, self.inc)) {
            st.dial(now, self.idx, dest);
        }
        let kind = MessageKind::of(&msg);
        // A lying peer: the blocks it names are past the end of its pool (its own grant,
        // above, is for the blocks it holds). Decode lies in an even request's transfer
        // info, prefill in an odd one's `Ready` (pull). (The id is parsed only when some
        // request has liars, or for a note.)
        let lies = if st.liars.is_empty() {
            None
        } else {
            req_index(id)
                .filter(|r| st.liars.contains(r))
                .map(|r| r % 2 == 0)
        };
        let msg = match (msg, lies) {
            (PeerMessage::TransferInfo { mode, blocks }, Some(true)) => PeerMessage::TransferInfo {
                mode,
                blocks: past_the_end(&blocks, st.pool_blocks(self.idx)),
            },
            (PeerMessage::Ready { blocks, aux, hold }, Some(false)) => PeerMessage::Ready {
                blocks: past_the_end(&blocks, st.pool_blocks(self.idx)),
                aux,
                hold,
            },
            (msg, _) => msg,
        };
        if st.faults_on && (st.drops.contains(&kind) || st.rng.chance(st.faults.loss_ppm)) {
            st.stats.lost += 1;
            st.note(
                now,
                req_index(id),
                format!("lose w{}->w{} {kind:?}", self.idx, dest.0),
            );
            return Ok(());
        }
        let copies = if st.faults_on && st.rng.chance(st.faults.dup_ppm) {
            st.stats.duplicated += 1;
            st.note(
                now,
                req_index(id),
                format!("duplicate w{}->w{} {kind:?}", self.idx, dest.0),
            );
            2
        } else {
            1
        };
        // The message itself goes with the last copy (a duplicate takes a clone).
        let mut msg = Some(msg);
        for copy in 1..=copies {
            let at = now + st.delay();
            let msg = if copy < copies {
                msg.clone()
            } else {
                msg.take()
            };
            let Some(msg) = msg else { break };
            net.push(
                st,
                at,
                NetEvent::Deliver(Box::new(Delivery {
                    from: self.idx,
                    from_inc: self.inc,
                    to: dest.0,
                    to_inc: dest.1,
                    id: id.clone(),
                    msg,
                    losses: st.losses_between(self.idx, dest.0),
                })),
            );
        }
        Ok(())
    }

    fn siblings(&self) -> Vec<Peer> {
        self.net
            .lock()
            .siblings
            .get(self.idx)
            .cloned()
            .unwrap_or_default()
    }

    fn resolve(&self, prefill: &EngineId, dp_rank: Option<u32>) -> ResolveFuture {
        let net = &self.net;
        let (tx, rx) = oneshot::channel();
        {
            let mut guard = net.lock();
            let st = &mut *guard;
            let now = net.now_ms();
            let lost = st.faults_on && st.rng.chance(st.faults.loss_ppm);
            let at = if lost {
                now + st.timing.query_timeout_ms
            } else {
                now + st.delay() + st.delay()
            };
            net.push(
                st,
                at,
                NetEvent::Query {
                    who: (self.idx, self.inc),
                    prefill: prefill.clone(),
                    dp: dp_rank,
                    lost,
                    reply: tx,
                },
            );
        }
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| {
                Err(ResolveError::NotReady {
                    detail: "bootstrap query abandoned".into(),
                })
            })
        })
    }

    fn write(
        &self,
        id: &RequestId,
        to: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: Instant,
    ) -> TransferFuture {
        self.transfer(id, &self.me, to, src, dst, deadline)
    }

    fn read(
        &self,
        id: &RequestId,
        from: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: Instant,
    ) -> TransferFuture {
        self.transfer(id, from, &self.me, src, dst, deadline)
    }

    fn request_ended(&self, id: &RequestId) {
        let mut st = self.net.lock();
        if let Some(node) = st.node_mut(self.idx) {
            node.rkeys.remove(id);
        }
        if let Some(node) = st.node_at(self.idx).filter(|n| n.inc == self.inc) {
            node.grants.revoke(id);
        }
    }

    fn detach(&self) {
        let mut st = self.net.lock();
        if let Some(n) = st.node_mut(self.idx) {
            if n.inc == self.inc {
                n.up = false;
                n.inbox = None;
            }
        }
    }
}
