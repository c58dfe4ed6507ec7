//! The control loop: one task per worker that owns every control connection.
//!
//! It multiplexes, in a fixed priority order (`biased`): messages from peers (on the
//! worker's ROUTER and on the DEALERs it dialed), dial results, commands from request
//! actors, and the heartbeat tick. All connection state lives here, so no lock is held
//! across an await and no two tasks disagree about a peer.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_transport::auth::Key;
use handoff_transport::lease::Lease;
use handoff_transport::same_host::PeerProcess;
use handoff_transport::wire::messages::{
    self, Heartbeat, Hello, HelloAck, LayoutDescriptor, Message, ProtocolError,
};
use handoff_transport::wire::{self, WireError};
use handoff_transport::zmtp::{ConnId, Dealer, DealerReceiver, DealerSender, Router, RouterEvent};
use handoff_transport::{BlockId, KvLayout, RankInfo, RequestId, Role};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, trace, warn};

use super::directory::DirectoryFuture;
use super::peers::{Incarnation, PeerTable};
use super::{
    check_named_blocks, Cmd, DataPlane, Directory, NetConfig, PeerData, PeerInfo, WriteGrants,
    DIAL_ATTEMPTS_MAX, DIAL_QUEUE_MESSAGES_MAX,
};
use handoff_actors::link::Inbox;
use handoff_actors::machine::{Peer, PeerMessage};

/// The time the peer table is given: the runtime's clock (real outside tests).
fn now() -> std::time::Instant {
    Instant::now().into_std()
}

pub(crate) struct Setup {
    pub(crate) cfg: NetConfig,
    pub(crate) me: RankInfo,
    pub(crate) role: Role,
    pub(crate) incarnation: u64,
    pub(crate) inbox: Inbox,
    pub(crate) router: Router,
    pub(crate) directory: Arc<dyn Directory>,
    pub(crate) data: Arc<dyn DataPlane>,
    /// This worker's layout as peers see it, sent in every `Hello`/`HelloAck`.
    pub(crate) descriptor: LayoutDescriptor,
    /// The same, checked: what peers' requests are paired against.
    pub(crate) layout: KvLayout,
    pub(crate) peer_data: PeerData,
    /// Woken whenever `peer_data` learns a connection (`NetLink::unwatched` waits on it).
    pub(crate) met: Arc<tokio::sync::Notify>,
    pub(crate) write_grants: Arc<Mutex<WriteGrants>>,
    pub(crate) cmds: mpsc::Receiver<Cmd>,
}

/// What tasks the loop spawned report back.
enum Report {
    Dialed {
        peer: Peer,
        generation: u64,
        result: Result<Box<Dialed>, DialFailure>,
    },
    FromDealer {
        peer: Peer,
        generation: u64,
        frames: Vec<Vec<u8>>,
    },
    DealerClosed {
        peer: Peer,
        generation: u64,
    },
}

struct Dialed {
    tx: DealerSender,
    rx: DealerReceiver,
    incarnation: u64,
    data_descriptor: Vec<u8>,
    layout: Option<LayoutDescriptor>,
    /// When our `Hello` went out: the peer heard us no earlier.
    hello_sent: std::time::Instant,
    /// The peer's loss timeout from its `HelloAck`.
    lease_ms: u64,
    /// What the peer offered of its process, and the connection's two ends.
    offered: Offered,
}

/// What a peer offered of its process in `Hello`/`HelloAck`, and our connection's two ends
/// (ours, the peer's) to check it against.
struct Offered {
    /// Its pid (0: none): verified, it is watched when it is a lost writer.
    pid: u32,
    /// It welcomes same-host copies with its memory through that pid.
    copies: bool,
    addrs: Option<(SocketAddr, SocketAddr)>,
}

/// Why a dial failed, and whether the peer said anything at all.
struct DialFailure {
    detail: String,
    /// Nothing answered within the timeout (no refusal, no reply): worth another try.
    silent: bool,
}

/// A failure the peer (or its absence from the directory) stated: not worth another try.
impl From<String> for DialFailure {
    fn from(detail: String) -> Self {
        Self {
            detail,
            silent: false,
        }
    }
}

/// A peer's connections (its liveness is in the [`PeerTable`]).
#[derive(Default)]
struct PeerState {
    /// Our connection to the peer's ROUTER, with its generation.
    out: Option<(DealerSender, u64)>,
    /// The peer's connection to our ROUTER.
    inbound: Option<ConnId>,
    dialing: Option<u64>,
    /// Dials in a row that nothing answered ([`DIAL_ATTEMPTS_MAX`]).
    silent_dials: u32,
    queue: VecDeque<Vec<u8>>,
}

impl PeerState {
    fn connected(&self) -> bool {
        self.out.is_some() || self.inbound.is_some()
    }
}

struct Control {
    cfg: NetConfig,
    me: RankInfo,
    role: Role,
    incarnation: u64,
    inbox: Inbox,
    router: Router,
    directory: Arc<dyn Directory>,
    data: Arc<dyn DataPlane>,
    descriptor: LayoutDescriptor,
    layout: KvLayout,
    peer_data: PeerData,
    met: Arc<tokio::sync::Notify>,
    /// Write grants and each peer's connection epoch ([`WriteGrants`]).
    write_grants: Arc<Mutex<WriteGrants>>,
    peers: BTreeMap<Peer, PeerState>,
    /// Every peer's liveness: incarnations, last heard, heartbeats, leases.
    table: PeerTable,
    conns: BTreeMap<ConnId, Peer>,
    /// Inbound connections refused (told why, and closed) that have not ended yet: what
    /// they still deliver was sent before the refusal reached them (a stale process's
    /// queued heartbeats, the rest of a flood) and is dropped unread, not refused again
    /// and counted as malformed. One entry per open connection at most: each goes at its
    /// `Disconnected`.
    refused: BTreeSet<ConnId>,
    /// Each inbound connection's two ends (ours, the peer's), from its `Connected`.
    conn_addrs: BTreeMap<ConnId, (SocketAddr, SocketAddr)>,
    reports: mpsc::Sender<Report>,
    generation: u64,
}

pub(crate) fn spawn(setup: Setup) -> tokio::task::JoinHandle<()> {
    let (reports, report_rx) = mpsc::channel(super::CONTROL_QUEUE_MESSAGES_MAX);
    let Setup {
        cfg,
        me,
        role,
        incarnation,
        inbox,
        router,
        directory,
        data,
        descriptor,
        layout,
        peer_data,
        met,
        write_grants,
        cmds,
    } = setup;
    let table = PeerTable::new(cfg.heartbeat_interval * cfg.heartbeats_missed_max);
    let control = Control {
        cfg,
        me,
        role,
        incarnation,
        inbox,
        router,
        directory,
        data,
        descriptor,
        layout,
        peer_data,
        met,
        write_grants,
        peers: BTreeMap::new(),
        table,
        conns: BTreeMap::new(),
        refused: BTreeSet::new(),
        conn_addrs: BTreeMap::new(),
        reports,
        generation: 0,
    };
    tokio::spawn(control.run(cmds, report_rx))
}

impl Control {
    async fn run(mut self, mut cmds: mpsc::Receiver<Cmd>, mut reports: mpsc::Receiver<Report>) {
        let mut tick = tokio::time::interval(self.cfg.heartbeat_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Resolves once the directory holds our rank for a newer process (never, where it
        // cannot tell): polled until then, and not after.
        let mut superseded: DirectoryFuture<String> = self
            .directory
            .superseded(&self.me, self.incarnation)
            .unwrap_or_else(|| Box::pin(std::future::pending()));
        let mut told = false;
        loop {
            tokio::select! {
                biased;
                event = self.router.recv() => match event {
                    Some(event) => self.on_router(event),
                    None => return,
                },
                detail = &mut superseded, if !told => {
                    told = true;
                    self.inbox.superseded(detail);
                }
                Some(report) = reports.recv() => self.on_report(report),
                cmd = cmds.recv() => match cmd {
                    Some(Cmd::Send { to, id, msg }) => self.send(&to, &id, msg),
                    Some(Cmd::Connect { peer }) => self.connect(&peer),
                    None => return, // the runtime is gone
                },
                _ = tick.tick() => self.heartbeat(),
            }
        }
    }

    fn key(&self) -> Option<&Key> {
        self.cfg.key.as_ref()
    }

    // ---- inbound ----

    fn on_router(&mut self, event: RouterEvent) {
        match event {
            RouterEvent::Connected { conn, peer, local } => {
                if let Some(local) = local {
                    self.conn_addrs.insert(conn, (local, peer));
                }
            }
            RouterEvent::Message { conn, peer, frames } => {
                if self.refused.contains(&conn) {
                    trace!(%peer, "dropping a message of a refused connection");
                    return;
                }
                if let Err(e) = self.on_conn_message(conn, &frames) {
                    warn!(peer = %peer, error = %e, "refusing malformed control message");
                    self.inbox.metrics().frame_refused(e.cause());
                    self.refuse(conn, e.to_string());
                }
            }
            RouterEvent::Disconnected { conn, .. } => {
                self.conn_addrs.remove(&conn);
                self.refused.remove(&conn);
                if let Some(peer) = self.conns.remove(&conn) {
                    if let Some(state) = self.peers.get_mut(&peer) {
                        state.inbound = state.inbound.filter(|c| *c != conn);
                    }
                    self.note_closed(&peer);
                    self.lose_if_unreachable(&peer, "its connection closed");
                }
            }
        }
    }

    /// Tells the other end of `conn` why (`ProtocolError`), and closes it.
    fn refuse(&mut self, conn: ConnId, why: String) {
        let reply = Message::ProtocolError(ProtocolError::new(why));
        if let Ok(bytes) = wire::encode(&reply, self.key()) {
            let _ = self.router.send(conn, vec![bytes]);
        }
        self.router.disconnect(conn);
        self.refused.insert(conn);
    }

    fn on_conn_message(&mut self, conn: ConnId, frames: &[Vec<u8>]) -> Result<(), WireError> {
        let [frame] = frames else {
            return Err(WireError::Invalid {
                what: "control message",
                detail: format!("{} frames, expected 1", frames.len()),
            });
        };
        let msg = wire::decode(frame, self.key())?;
        let Some(peer) = self.conns.get(&conn).cloned() else {
            let hello = messages::check_hello(&msg)?.clone();
            return self.on_hello(conn, hello);
        };
        self.on_peer_message(&peer, msg)
    }

    fn on_hello(&mut self, conn: ConnId, hello: Hello) -> Result<(), WireError> {
        let peer = hello.rank.clone();
        if let Err(current) = self.note_incarnation(&peer, hello.incarnation) {
            // Told why, and the connection goes (counted and logged above).
            let why = format!(
                "incarnation {} of {peer} is older than {current}, which holds the rank now",
                hello.incarnation
            );
            self.refuse(conn, why);
            return Ok(());
        }
        let offered = Offered {
            pid: hello.pid,
            copies: hello.copies,
            addrs: self.conn_addrs.get(&conn).copied(),
        };
        let lease = self.remember_data(
            &peer,
            hello.incarnation,
            hello.data_descriptor,
            hello.layout,
            offered,
        )?;
        // The peer hears us (our ack) no earlier than now.
        lease.extend_to(std::time::Instant::now() + self.peer_lease(hello.lease_ms));
        self.conns.insert(conn, peer.clone());
        let state = self.peers.entry(peer.clone()).or_default();
        state.inbound = Some(conn);
        self.table.connected(&peer, now(), lease);
        debug!(%peer, role = %hello.role, "peer connected");
        let mut ack = HelloAck::new(self.incarnation);
        ack.data_descriptor = self.data.data_descriptor();
        ack.layout = Some(self.descriptor.clone());
        ack.lease_ms = self.loss_timeout_ms();
        ack.pid = self.offered_pid();
        ack.copies = self.data.offers_same_host_copies();
        let ack = wire::encode(&Message::HelloAck(ack), self.key())?;
        // A peer that said a valid hello: outside the bounds on pending connections.
        self.router.admit(conn);
        let _ = self.router.send(conn, vec![ack]);
        self.flush(&peer);
        Ok(())
    }

    /// A new incarnation of a known peer means the old one is gone: its requests fail now,
    /// and the runtime learns that the rank's answers are the new process's from now on
    /// (`Inbox::peer_replaced`), before anything the new one says is delivered. An older
    /// incarnation than the one we know is refused: `Err` with the one we know.
    fn note_incarnation(&mut self, peer: &Peer, incarnation: u64) -> Result<(), u64> {
        let replaced = match self.table.incarnation(peer, incarnation) {
            Incarnation::Unchanged if self.table.is_lost(peer) => {
                // The very process we lost answers: paused (SIGSTOP, a long stall), not
                // dead. New requests may be paired with it again (the directory may still
                // refuse it to them: `found` says whether it did).
                let refused = self.directory.found(peer, incarnation);
                info!(%peer, incarnation, refused_until_now = refused, "a peer lost at this incarnation answers again: new requests may pair with it");
                false
            }
            Incarnation::First | Incarnation::Unchanged => false,
            Incarnation::Back { old } => {
                info!(%peer, old, new = incarnation, "peer back with a new incarnation");
                true
            }
            Incarnation::Restarted { old } => {
                info!(%peer, old, new = incarnation, "peer restarted: failing requests of its old incarnation");
                self.lose(peer, "it restarted with a new incarnation");
                true
            }
            Incarnation::Stale { current } => {
                warn!(%peer, stale = incarnation, current, "refusing an older process of a peer whose rank a newer one holds");
                self.inbox.metrics().frame_refused("stale_incarnation");
                return Err(current);
            }
        };
        self.table.adopt(peer, incarnation);
        if replaced {
            self.inbox.peer_replaced(peer.clone());
        }
        Ok(())
    }

    fn on_peer_message(&mut self, peer: &Peer, msg: Message) -> Result<(), WireError> {
        self.table.heard(peer, now());
        let (id, outbound) = match msg {
            Message::Heartbeat(Heartbeat {
                incarnation,
                seq,
                echo,
                lease_ms,
            }) => {
                if self.note_incarnation(peer, incarnation).is_err() {
                    return Ok(()); // dropped, counted and logged
                }
                self.on_echo(peer, seq, echo, lease_ms);
                return Ok(());
            }
            Message::HelloAck(_) | Message::ProtocolError(_) => return Ok(()),
            Message::TransferInfo(t) => {
                if !self.current(peer, t.incarnation) {
                    return Ok(());
                }
                if t.decode != *peer {
                    return Err(WireError::Invalid {
                        what: "TransferInfo.decode",
                        detail: format!("{} on a connection from {peer}", t.decode),
                    });
                }
                // We are the source, the decode rank the destination.
                if let Err(e) = self.check_pairing(peer, &t.blocks, true) {
                    self.inbox.deliver_invalid(peer.clone(), t.request_id, e);
                    return Ok(());
                }
                // Written under only while we stay connected to it ([`WriteGrants`]).
                self.write_grants
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .record(&t.request_id, peer);
                (
                    t.request_id,
                    PeerMessage::TransferInfo {
                        mode: t.mode,
                        blocks: t.blocks,
                    },
                )
            }
            Message::Ready(r) => {
                // The prefill rank is the source, we are the destination.
                if let Err(e) = self.check_pairing(peer, &r.blocks, false) {
                    self.inbox.deliver_invalid(peer.clone(), r.request_id, e);
                    return Ok(());
                }
                (
                    r.request_id,
                    PeerMessage::Ready {
                        blocks: r.blocks,
                        aux: r.aux,
                        hold: Duration::from_millis(r.hold_ms),
                    },
                )
            }
            Message::Queued(q) => (q.request_id, PeerMessage::Queued),
            Message::Rejected(r) => (r.request_id, PeerMessage::Rejected { reason: r.reason }),
            Message::Done(d) => (d.request_id, PeerMessage::Done { aux: d.aux }),
            Message::ReadDone(d) => (d.request_id, PeerMessage::ReadDone),
            Message::Abort(a) => (a.request_id, PeerMessage::Abort { reason: a.reason }),
            Message::AbortAck(a) => (a.request_id, PeerMessage::AbortAck),
            other => {
                return Err(WireError::Invalid {
                    what: "control message",
                    detail: format!("{} is not a peer message", other.message_type().name()),
                });
            }
        };
        trace!(request = %id, %peer, message = outbound.name(), "control message in");
        self.inbox.deliver(peer.clone(), id, outbound);
        Ok(())
    }

    /// False (and logged) for a message stamped with an incarnation the peer no longer has.
    fn current(&self, peer: &Peer, incarnation: u64) -> bool {
        if !self.table.current(peer, incarnation) {
            let known = self.table.known_incarnation(peer);
            warn!(%peer, stale = incarnation, current = ?known, "dropping a message from an old incarnation");
            self.inbox.metrics().frame_refused("stale_incarnation");
            return false;
        }
        true
    }

    /// Before a byte of a request moves: the peer's layout (from its hello) must hold the
    /// blocks it names, and pair with ours (same whole-model block, bytes per layer,
    /// tokens per block and element size, or heads between TP sizes; [`layer_slices`]).
    /// `we_send`: we are the source.
    /// The error fails that request with a protocol error naming the peer.
    fn check_pairing(&self, peer: &Peer, blocks: &[BlockId], we_send: bool) -> Result<(), String> {
        let map = self.peer_data.lock().unwrap_or_else(|e| e.into_inner());
        let theirs = map
            .get(peer)
            .and_then(|p| p.layout.as_ref())
            .map(|(_, l)| l);
        check_named_blocks(&self.me, &self.layout, peer, theirs, blocks, we_send)
    }

    /// What a peer said about its data plane at connect: transfers to it never need the
    /// bootstrap server. A layout that does not describe memory (already refused by the
    /// wire's validation, checked again here) costs the connection.
    fn remember_data(
        &self,
        peer: &Peer,
        incarnation: u64,
        data_descriptor: Vec<u8>,
        layout: Option<LayoutDescriptor>,
        offered: Offered,
    ) -> Result<Arc<Lease>, WireError> {
        let layout = match layout {
            Some(descriptor) => {
                let checked = descriptor.to_layout()?;
                Some((descriptor, checked))
            }
            None => None,
        };
        // Host memory (kernel copies), or device memory whose allocations travel as CUDA
        // IPC descriptors (device copies through them): either needs the peer verified to
        // be the process at the other end of this connection.
        let reachable = layout.as_ref().is_some_and(|(d, _)| {
            d.cuda_device.is_none() || d.ranges.iter().all(|r| !r.cuda_ipc.is_empty())
        });
        // The lane copies with the peer's memory directly when both sides want it; the
        // process is verified for that, and on a one-sided plane in any case, to be
        // watched should it be lost as a writer (`NetLink::writer_exit`).
        let copies = offered.copies && reachable && self.data.same_host_copies();
        let verify = match offered.addrs {
            Some((ours, theirs)) if offered.pid != 0 && (copies || self.data.one_sided()) => {
                Some((offered.pid, ours, theirs))
            }
            _ => None,
        };
        let mut map = self.peer_data.lock().unwrap_or_else(|e| e.into_inner());
        // A new connection's lease: the old one's proofs were about the old connection.
        let lease = Arc::new(Lease::new());
        let (checked, verifying) = match verify {
            Some(_) => {
                let (tx, rx) = tokio::sync::watch::channel(false);
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
        // The old connection's process may still hold a post of a lost writer: kept for
        // quarantines while it lives.
        let old = map.remove(peer);
        let mut writers = old.as_ref().map(|o| o.writers.clone()).unwrap_or_default();
        if let Some(o) = &old {
            if let Some((dropped, _)) =
                writers.superseded(o.incarnation, o.process.clone(), |p| p.alive())
            {
                warn!(%peer, incarnation = dropped, "too many earlier processes of this rank live on: the oldest is watched no more");
            }
        }
        map.insert(
            peer.clone(),
            PeerInfo {
                data_descriptor,
                layout,
                lease: lease.clone(),
                process: None,
                copies,
                verifying,
                incarnation,
                writers,
            },
        );
        drop(map);
        self.met.notify_waiters();
        if let Some(old) = old {
            old.lease.revoke();
        }
        if let (Some((pid, ours, theirs)), Some(checked)) = (verify, checked) {
            // Off this loop: the kernel's socket tables can be long on a busy host. Until
            // it is done the plane's other lanes carry the peer's host-memory transfers;
            // transfers with its device memory wait for it (`SAME_HOST_CHECK_WAIT_MAX`).
            let (peer_data, peer, lease) = (self.peer_data.clone(), peer.clone(), lease.clone());
            tokio::task::spawn_blocking(move || {
                if let Some(process) = same_host_process(&peer, copies, pid, ours, theirs) {
                    let mut map = peer_data.lock().unwrap_or_else(|e| e.into_inner());
                    // Only for this very connection (the lease is per connection).
                    if let Some(info) = map.get_mut(&peer).filter(|i| Arc::ptr_eq(&i.lease, &lease))
                    {
                        info.process = Some(process);
                    }
                }
                // Done, whatever it found (after `process` is set, so waiters see it).
                let _ = checked.send(true);
            });
        }
        Ok(lease)
    }

    /// Our pid in `Hello`/`HelloAck`: on a one-sided plane, so that a same-host peer can
    /// watch us should it lose us as a writer, and when same-host peers should copy with
    /// our memory directly ([`DataPlane::offers_same_host_copies`]).
    fn offered_pid(&self) -> u32 {
        if self.data.one_sided() || self.data.offers_same_host_copies() {
            std::process::id()
        } else {
            0
        }
    }

    /// How long we wait, after last hearing from a peer, before we take it as lost.
    fn loss_timeout(&self) -> Duration {
        self.cfg.heartbeat_interval * self.cfg.heartbeats_missed_max
    }

    fn loss_timeout_ms(&self) -> u64 {
        u64::try_from(self.loss_timeout().as_millis()).unwrap_or(u64::MAX)
    }

    /// A peer's loss timeout as it stated it (in `Hello`, `HelloAck`, heartbeats); ours
    /// where it said nothing.
    fn peer_lease(&self, lease_ms: u64) -> Duration {
        if lease_ms == 0 {
            self.loss_timeout()
        } else {
            Duration::from_millis(lease_ms)
        }
    }

    /// A peer's heartbeat: remember its seq (echoed in ours), and if it echoes one of
    /// ours, the peer heard us no earlier than we sent that one, so it will not take us as
    /// lost before then plus its loss timeout: extend our writer's lease to that
    /// ([`PeerTable::heartbeat`]). A beat of its tick is answered at once.
    fn on_echo(&mut self, peer: &Peer, seq: u64, echo: u64, lease_ms: u64) {
        let lease_for = self.peer_lease(lease_ms);
        let Some(answer) = self.table.heartbeat(peer, seq, echo, lease_for) else {
            return;
        };
        let answer = Message::Heartbeat(Heartbeat {
            incarnation: self.incarnation,
            seq: 0,
            echo: answer,
            lease_ms: self.loss_timeout_ms(),
        });
        if let Ok(bytes) = wire::encode(&answer, self.key()) {
            if let Some(state) = self.peers.get_mut(peer) {
                state.queue.push_back(bytes);
                self.flush(peer);
            }
        }
    }

    fn on_report(&mut self, report: Report) {
        match report {
            Report::Dialed {
                peer,
                generation,
                result,
            } => self.on_dialed(peer, generation, result),
            Report::FromDealer {
                peer,
                generation,
                frames,
            } => {
                if self
                    .peers
                    .get(&peer)
                    .and_then(|s| s.out.as_ref())
                    .is_none_or(|(_, g)| *g != generation)
                {
                    return; // from a connection we already dropped
                }
                let result = match frames.as_slice() {
                    [frame] => {
                        wire::decode(frame, self.key()).and_then(|m| self.on_peer_message(&peer, m))
                    }
                    _ => Err(WireError::Invalid {
                        what: "control message",
                        detail: format!("{} frames", frames.len()),
                    }),
                };
                if let Err(e) = result {
                    warn!(%peer, error = %e, "malformed message from a peer we dialed; dropping the connection");
                    self.inbox.metrics().frame_refused(e.cause());
                    self.drop_out(&peer, generation);
                }
            }
            Report::DealerClosed { peer, generation } => self.drop_out(&peer, generation),
        }
    }

    fn drop_out(&mut self, peer: &Peer, generation: u64) {
        if let Some(state) = self.peers.get_mut(peer) {
            if state.out.as_ref().is_some_and(|(_, g)| *g == generation) {
                state.out = None;
            }
        }
        self.note_closed(peer);
        self.lose_if_unreachable(peer, "its connection closed");
    }

    /// A connection with `peer` closed: once none is left, the peer may have taken us as
    /// lost (it closes every connection when it does), so its write grants so far are void
    /// even if we reconnect at once.
    fn note_closed(&mut self, peer: &Peer) {
        if self.peers.get(peer).is_none_or(|s| !s.connected()) {
            self.write_grants
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .disconnected(peer);
        }
    }

    // ---- outbound ----

    fn encode(&self, id: &RequestId, msg: PeerMessage) -> Result<Vec<u8>, WireError> {
        let id = id.clone();
        let wire_msg = match msg {
            PeerMessage::TransferInfo { mode, blocks } => {
                Message::TransferInfo(messages::TransferInfo {
                    request_id: id,
                    decode: self.me.clone(),
                    incarnation: self.incarnation,
                    mode,
                    blocks,
                })
            }
            PeerMessage::Queued => Message::Queued(messages::Queued { request_id: id }),
            PeerMessage::Rejected { reason } => {
                Message::Rejected(messages::Rejected::new(id, reason))
            }
            PeerMessage::Ready { blocks, aux, hold } => Message::Ready(messages::Ready {
                request_id: id,
                blocks,
                aux,
                hold_ms: u64::try_from(hold.as_millis()).unwrap_or(u64::MAX),
            }),
            PeerMessage::Done { aux } => Message::Done(messages::Done {
                request_id: id,
                aux,
            }),
            PeerMessage::ReadDone => Message::ReadDone(messages::ReadDone { request_id: id }),
            PeerMessage::Abort { reason } => Message::Abort(messages::Abort::new(id, reason)),
            PeerMessage::AbortAck => Message::AbortAck(messages::AbortAck { request_id: id }),
        };
        wire::encode(&wire_msg, self.key())
    }

    fn send(&mut self, to: &Peer, id: &RequestId, msg: PeerMessage) {
        trace!(request = %id, peer = %to, message = msg.name(), "control message out");
        let bytes = match self.encode(id, msg) {
            Ok(bytes) => bytes,
            Err(e) => {
                warn!(request = %id, peer = %to, error = %e, "cannot encode a control message");
                self.inbox.deliver_invalid(
                    to.clone(),
                    id.clone(),
                    format!("cannot encode our message: {e}"),
                );
                return;
            }
        };
        let state = self.peers.entry(to.clone()).or_default();
        if state.queue.len() >= DIAL_QUEUE_MESSAGES_MAX {
            warn!(peer = %to, "too many messages waiting for a connection; peer treated as lost");
            self.inbox.metrics().frame_refused("queue_full");
            return self.lose(to, "too many messages waiting for a connection");
        }
        state.queue.push_back(bytes);
        if state.connected() {
            self.flush(to);
        } else if state.dialing.is_none() {
            self.dial(to);
        }
    }

    /// Dials `peer` unless a connection to it is up or on its way (`NetLink::unwatched`).
    fn connect(&mut self, peer: &Peer) {
        let state = self.peers.entry(peer.clone()).or_default();
        if !state.connected() && state.dialing.is_none() {
            self.dial(peer);
        }
    }

    /// Sends everything queued for a peer over its best connection.
    fn flush(&mut self, peer: &Peer) {
        let Some(state) = self.peers.get_mut(peer) else {
            return;
        };
        while let Some(bytes) = state.queue.pop_front() {
            let sent = match (&state.out, state.inbound) {
                (Some((tx, _)), _) => tx.send(vec![bytes]).is_ok(),
                (None, Some(conn)) => self.router.send(conn, vec![bytes]).is_ok(),
                (None, None) => {
                    state.queue.push_front(bytes);
                    return;
                }
            };
            if !sent {
                return self.lose(peer, "its connection refused a message");
            }
        }
    }

    fn dial(&mut self, peer: &Peer) {
        self.generation += 1;
        let generation = self.generation;
        if let Some(state) = self.peers.get_mut(peer) {
            state.dialing = Some(generation);
        }
        let job = DialJob {
            directory: self.directory.clone(),
            hello: Hello {
                data_descriptor: self.data.data_descriptor(),
                layout: Some(self.descriptor.clone()),
                lease_ms: self.loss_timeout_ms(),
                pid: self.offered_pid(),
                copies: self.data.offers_same_host_copies(),
                ..Hello::new(self.role, self.me.clone(), self.incarnation)
            },
            key: self.cfg.key.clone(),
            peer: peer.clone(),
            timeout: self.cfg.connect_timeout,
        };
        let reports = self.reports.clone();
        let peer = peer.clone();
        tokio::spawn(async move {
            let result = job.run().await.map(Box::new);
            let _ = reports
                .send(Report::Dialed {
                    peer,
                    generation,
                    result,
                })
                .await;
        });
    }

    fn on_dialed(&mut self, peer: Peer, generation: u64, result: Result<Box<Dialed>, DialFailure>) {
        let Some(state) = self.peers.get_mut(&peer) else {
            return;
        };
        if state.dialing != Some(generation) {
            return;
        }
        state.dialing = None;
        match &result {
            Ok(_) => state.silent_dials = 0,
            Err(failure) if failure.silent => state.silent_dials += 1,
            Err(_) => {}
        }
        let again = state.silent_dials < DIAL_ATTEMPTS_MAX;
        match result.map(|d| *d) {
            Ok(Dialed {
                tx,
                mut rx,
                incarnation,
                data_descriptor,
                layout,
                hello_sent,
                lease_ms,
                offered,
            }) => {
                // Who answered first: a restart fails the old incarnation's requests (and
                // ends this connection's state with them: the next message dials again),
                // and an older process than the one we know is refused.
                if let Err(current) = self.note_incarnation(&peer, incarnation) {
                    let why = format!(
                        "{peer} answered as incarnation {incarnation}, older than {current}"
                    );
                    return self.lose(&peer, &why);
                }
                let lease = match self.remember_data(
                    &peer,
                    incarnation,
                    data_descriptor,
                    layout,
                    offered,
                ) {
                    Ok(lease) => lease,
                    Err(e) => {
                        warn!(%peer, error = %e, "peer's hello answer describes bad memory");
                        return self.lose(&peer, &e.to_string());
                    }
                };
                // The peer heard us (our hello) no earlier than when we sent it.
                lease.extend_to(hello_sent + self.peer_lease(lease_ms));
                let Some(state) = self.peers.get_mut(&peer) else {
                    return;
                };
                state.out = Some((tx, generation));
                self.table.connected(&peer, now(), lease);
                let reports = self.reports.clone();
                let who = peer.clone();
                tokio::spawn(async move {
                    while let Some(frames) = rx.recv().await {
                        let report = Report::FromDealer {
                            peer: who.clone(),
                            generation,
                            frames,
                        };
                        if reports.send(report).await.is_err() {
                            return;
                        }
                    }
                    let _ = reports
                        .send(Report::DealerClosed {
                            peer: who,
                            generation,
                        })
                        .await;
                });
                self.flush(&peer);
            }
            Err(DialFailure { detail, silent }) if silent && again => {
                // The messages for it stay queued; this try is bounded like the last.
                warn!(%peer, error = %detail, "peer did not answer; dialing it again");
                self.dial(&peer);
            }
            Err(DialFailure { detail, .. }) => {
                warn!(%peer, error = %detail, "cannot reach peer");
                self.lose(&peer, &detail);
            }
        }
    }

    // ---- liveness ----

    fn heartbeat(&mut self) {
        let now = now();
        let timeout = self.table.loss_timeout();
        for peer in self.table.silent(now) {
            if self.peers.get(&peer).is_some_and(|s| s.connected()) {
                self.lose(&peer, &format!("no heartbeat for {timeout:?}"));
            }
        }
        let peers: Vec<Peer> = self
            .peers
            .iter()
            .filter(|(_, s)| s.connected())
            .map(|(p, _)| p.clone())
            .collect();
        self.inbox.metrics().set_peers_live(peers.len());
        let lease_ms = self.loss_timeout_ms();
        for peer in peers {
            let (seq, echo) = self.table.beat(&peer, std::time::Instant::now());
            let beat = Message::Heartbeat(Heartbeat {
                incarnation: self.incarnation,
                seq,
                echo,
                lease_ms,
            });
            if let Ok(bytes) = wire::encode(&beat, self.cfg.key.as_ref()) {
                if let Some(state) = self.peers.get_mut(&peer) {
                    state.queue.push_back(bytes);
                    self.flush(&peer);
                }
            }
        }
    }

    fn lose_if_unreachable(&mut self, peer: &Peer, why: &str) {
        if self
            .peers
            .get(peer)
            .is_some_and(|s| !s.connected() && s.dialing.is_none())
        {
            self.lose(peer, why);
        }
    }

    /// Forgets a peer and fails every request that depends on it, at once.
    fn lose(&mut self, peer: &Peer, why: &str) {
        // First of all: no write of ours into its memory is posted from now on (the
        // table revokes our lease), and only its incarnation is kept, marked lost, so a
        // late message of the old incarnation is still stale.
        let known = self.table.lose(peer);
        let state = self.peers.remove(peer);
        self.write_grants
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .disconnected(peer);
        if state.is_none() && !known {
            return;
        }
        if let Some(conn) = state.and_then(|s| s.inbound) {
            self.conns.remove(&conn);
            self.router.disconnect(conn);
        }
        warn!(%peer, %why, "peer lost");
        match self.table.known_incarnation(peer) {
            Some(incarnation) => self.directory.lost(peer, incarnation),
            None => self.directory.invalidate(&peer.engine_id),
        }
        self.inbox.peer_lost(peer.clone());
    }
}

/// The peer's process if the kernel shows that `pid` holds the other end of our connection
/// from `ours` to `theirs` ([`PeerProcess::verify`]); a peer on another host, in another
/// namespace or under another user is simply reached by the plane's other lanes (and not
/// watched). `copies`: the lane will copy with it (for the log).
fn same_host_process(
    peer: &Peer,
    copies: bool,
    pid: u32,
    ours: SocketAddr,
    theirs: SocketAddr,
) -> Option<Arc<PeerProcess>> {
    match PeerProcess::verify(pid, ours, theirs) {
        Ok(process) => {
            if copies {
                info!(%peer, pid, "same-host copies with this peer verified (kernel cross-memory attach for host memory, CUDA IPC for device memory)");
            } else {
                info!(%peer, pid, "peer's process verified on this host: watched should it be lost as a writer (no same-host copies)");
            }
            Some(Arc::new(process))
        }
        Err(e) => {
            debug!(%peer, error = %e, "peer's process not verified on this host: not watched, no same-host copies");
            None
        }
    }
}

/// Everything a dial needs, moved into its task.
struct DialJob {
    directory: Arc<dyn Directory>,
    hello: Hello,
    key: Option<Key>,
    peer: Peer,
    timeout: Duration,
}

impl DialJob {
    /// Looks the peer up, connects, says `Hello` and waits for `HelloAck`, all within the
    /// timeout.
    async fn run(self) -> Result<Dialed, DialFailure> {
        let work = async {
            // Lost workers included: a peer lost at the incarnation the directory still
            // holds may be back (stopped, then resumed), and this dial is how we find out.
            let records = self
                .directory
                .lookup_including_lost(&self.peer.engine_id)
                .await
                .map_err(|e| format!("{e:?}"))?;
            let record = records
                .iter()
                .find(|r| r.rank == self.peer)
                .ok_or_else(|| format!("{} is not registered", self.peer))?;
            let dealer =
                Dealer::connect_with(&record.control_address, b"", self.timeout, self.key.clone())
                    .await
                    .map_err(|e| DialFailure {
                        silent: matches!(
                            e,
                            handoff_transport::zmtp::ZmtpError::HandshakeTimeout(_)
                        ),
                        detail: format!("{}: {e}", record.control_address),
                    })?;
            let addrs = dealer.socket_addrs();
            let (tx, mut rx) = dealer.split();
            let hello = wire::encode(&Message::Hello(self.hello.clone()), self.key.as_ref())
                .map_err(|e| e.to_string())?;
            let hello_sent = std::time::Instant::now();
            tx.send(vec![hello]).map_err(|e| e.to_string())?;
            let frames = rx.recv().await.ok_or_else(|| {
                format!(
                    "{} closed the connection during hello",
                    record.control_address
                )
            })?;
            let [frame] = frames.as_slice() else {
                return Err(format!(
                    "{}: a reply of {} frames",
                    record.control_address,
                    frames.len()
                )
                .into());
            };
            let reply = wire::decode(frame, self.key.as_ref())
                .map_err(|e| format!("{}: {e}", record.control_address))?;
            if let Message::ProtocolError(p) = &reply {
                return Err(format!("{} refused us: {}", record.control_address, p.detail).into());
            }
            let ack = messages::check_hello_ack(&reply)
                .map_err(|e| format!("{}: {e}", record.control_address))?;
            Ok::<Dialed, DialFailure>(Dialed {
                tx,
                rx,
                incarnation: ack.incarnation,
                data_descriptor: ack.data_descriptor.clone(),
                layout: ack.layout.clone(),
                hello_sent,
                lease_ms: ack.lease_ms,
                offered: Offered {
                    pid: ack.pid,
                    copies: ack.copies,
                    addrs,
                },
            })
        };
        match tokio::time::timeout(self.timeout, work).await {
            Ok(result) => result,
            Err(_) => Err(DialFailure {
                detail: format!("no answer from {} within {:?}", self.peer, self.timeout),
                silent: true,
            }),
        }
    }
}
