//! The request actor: one per live request, supervised by the runtime's root actor.
//!
//! It owns its request's machine and does nothing else: it feeds the machine the events
//! the root routes to it, performs the actions the machine emits (control messages through
//! the [`Link`], data transfers, state and releases into the request's [`Estate`], which
//! it alone owns while it runs), and waits for whichever comes first: a message, one of
//! its waits (a transfer's answer, a lost writer's exit, the bootstrap lookup), or the
//! machine's next deadline. When the machine is terminal it tells the root, which stops it.
//!
//! It is one tokio task reading one unbounded mailbox (bounded in practice by admission:
//! the root delivers a request's events), as the root is: per request no actor
//! framework's ports, registration or supervision link, no timer task per deadline and no
//! task per transfer or lookup (the loop polls its waits and waits for the deadline
//! itself). A bootstrap lookup the directory answers from its cache is taken at once, in
//! the actor's start; one it cannot is a wait like a transfer. Supervision stays the
//! root's: a panic in a handler (or in a wait the loop polls) is caught here, the task
//! ends, and the root is told ([`RootMsg::ChildGone`]); stopping is aborting the task,
//! which drops its state and with it every transfer and lookup it started.

use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_transport::{EngineId, RequestId, Role, TransferMode};

use tokio::task::AbortHandle;
use tracing::{debug, warn, Instrument, Span};

use crate::estate::{Consignment, Deed, Estate};
use crate::link::{Link, ResolveError, TransferError, PLANE_ANSWER_GRACE};
use crate::machine::{
    Action, ReceiverEvent, ReceiverMachine, SenderEvent, SenderMachine, State, Timeouts,
};
use crate::mailbox;
use crate::metrics::Metrics;
use crate::router::{Local, MachineEvent};
use crate::runtime::{RootMsg, RootRef};

/// First wait between bootstrap lookups that answer "not ready".
pub const RESOLVE_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Cap on the wait between bootstrap lookups; the request's bootstrap deadline caps the total.
pub const RESOLVE_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How long a decode request that failed before resolving its prefill ranks may spend
/// looking them up to tell them.
pub const ABORT_LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// Messages a request actor handles.
#[derive(Debug)]
pub(crate) enum RequestMsg {
    /// Something happened to the request.
    Event(MachineEvent),
    /// The engine handed the request's blocks over: `event` says so to the machine, and
    /// `blocks` carries them to the estate.
    HandOver {
        event: MachineEvent,
        blocks: Consignment,
    },
    /// The armed deadline may have passed.
    Timeout,
    /// Fault injection: panic inside the handler (tests and the simulator).
    Panic,
    /// One of the actor's waits (a transfer, a writer's exit, the bootstrap lookup)
    /// panicked while the actor polled it (its text): a bug in a plane or a directory.
    WaitPanicked(String),
}

/// What a request actor is built from.
pub(crate) struct RequestArgs {
    pub(crate) id: RequestId,
    pub(crate) role: Role,
    /// The request's estate: this actor's alone while it runs.
    pub(crate) deed: Deed,
    pub(crate) link: Arc<dyn Link>,
    pub(crate) root: RootRef,
    pub(crate) timeouts: Timeouts,
    pub(crate) kind: Kind,
    /// Events that arrived before the request existed.
    pub(crate) backlog: Vec<MachineEvent>,
    pub(crate) metrics: Arc<Metrics>,
}

/// Which side, and what that side needs to start.
pub(crate) enum Kind {
    Sender,
    Receiver {
        mode: TransferMode,
        prefill: EngineId,
        prefill_dp_rank: Option<u32>,
    },
}

/// A request actor's mailbox, for whoever reports to it (the root, its own transfers and
/// lookups). A send to an actor that is gone gives the message back (and a consignment in
/// it gives its blocks back to the engine when dropped).
#[derive(Clone)]
pub(crate) struct RequestRef(mailbox::Sender<RequestMsg>);

impl RequestRef {
    /// False if the actor is gone (the message, dropped, gave back what it carried).
    pub(crate) fn cast(&self, msg: RequestMsg) -> bool {
        self.0.send(msg).is_ok()
    }
}

/// A running request actor, as the root holds it.
pub(crate) struct RequestTask {
    pub(crate) addr: RequestRef,
    /// Which spawn this is: a `ChildGone` of another one is stale.
    pub(crate) serial: u64,
    abort: AbortHandle,
}

impl RequestTask {
    /// Sends the actor a message; false once it is gone (its mailbox dropped with it).
    pub(crate) fn cast(&self, msg: RequestMsg) -> bool {
        self.addr.cast(msg)
    }

    /// Stops the actor: its state (and every task it started) is dropped, and what is
    /// left in its mailbox with it.
    pub(crate) fn stop(&self) {
        self.abort.abort();
    }
}

/// Starts a request actor on the current tokio runtime.
pub(crate) fn spawn(args: RequestArgs, serial: u64) -> RequestTask {
    let (tx, rx) = mailbox::channel();
    let addr = RequestRef(tx);
    // Boxed: the task then holds a pointer, not the actor's whole state, so tokio's moves
    // of the task's stage (at spawn and at the end) copy 8 bytes, not kilobytes.
    // The arguments boxed too: a future keeps its arguments' slots for its whole life, and
    // these are read once, at the start (192 bytes, against 8).
    let task = tokio::spawn(Box::pin(run(Box::new(args), addr.clone(), rx, serial)));
    RequestTask {
        addr,
        serial,
        abort: task.abort_handle(),
    }
}

/// The actor's life: start, then one message (or deadline) at a time, each handled
/// synchronously under `catch_unwind`, until it is stopped or panics.
async fn run(
    args: Box<RequestArgs>,
    myself: RequestRef,
    mut rx: mailbox::Receiver<RequestMsg>,
    serial: u64,
) {
    let (id, root) = (args.id.clone(), args.root.clone());
    let gone = |why: String| {
        let _ = root.cast(RootMsg::ChildGone {
            id: id.clone(),
            serial,
            why,
        });
    };
    // Boxed: the task's future then holds a pointer to the state, not the state itself. A
    // future keeps a slot for each value it holds across an await, and its whole size is
    // copied into the task at spawn: 1,888 bytes with the state inline, 712 boxed.
    let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Box::new(RequestState::start(&myself, *args))
    }));
    let mut state = match started {
        Ok(state) => state,
        Err(panic) => return gone(panic_text(panic.as_ref())),
    };
    // Reset to the machine's deadline whenever there is one; never reached otherwise.
    let sleep = tokio::time::sleep_until(tokio::time::Instant::now() + IDLE_SLEEP);
    tokio::pin!(sleep);
    loop {
        if let Some(at) = state.timer {
            let at = tokio::time::Instant::from_std(at);
            if sleep.deadline() != at {
                sleep.as_mut().reset(at);
            }
        }
        let timed = state.timer.is_some();
        let waits = &mut state.waits;
        // The machine's deadline before a transfer's answer due at the same instant: a
        // plane answers a transfer past its deadline at that deadline, and the request
        // fails for the deadline, not for the plane's answer.
        let msg = tokio::select! {
            biased;
            msg = rx.recv() => match msg {
                Some(msg) => msg,
                // Every sender gone: the root forgot the request and nothing reports to it.
                None => return,
            },
            () = &mut sleep, if timed => RequestMsg::Timeout,
            answer = next_answer(waits), if !waits.is_empty() => match answer {
                Some(msg) => msg,
                // A wait that ended with nothing to say (a lookup past its deadline).
                None => continue,
            },
        };
        let handled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| state.handle(&myself, msg)));
        if let Err(panic) = handled {
            return gone(panic_text(panic.as_ref()));
        }
    }
}

/// Something the actor waits for beside its mailbox and deadline (a transfer, a lost
/// writer's exit, the bootstrap lookup), polled by its own loop: the machine's event it
/// ends as, or nothing (a lookup that gave up at its deadline).
type Wait = std::pin::Pin<Box<dyn std::future::Future<Output = Option<MachineEvent>> + Send>>;

/// The first wait to end, removed from `waits`: its event as a message (`None`: it ended
/// with nothing to say); a wait that panics (a bug in a plane or a directory) is reported
/// as the actor's own panic.
async fn next_answer(waits: &mut Vec<Wait>) -> Option<RequestMsg> {
    std::future::poll_fn(|cx| {
        let mut i = 0;
        while i < waits.len() {
            let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                waits[i].as_mut().poll(cx)
            }));
            match polled {
                Ok(std::task::Poll::Pending) => i += 1,
                Ok(std::task::Poll::Ready(event)) => {
                    drop(waits.swap_remove(i));
                    return std::task::Poll::Ready(event.map(RequestMsg::Event));
                }
                Err(panic) => {
                    drop(waits.swap_remove(i));
                    let text = panic_payload(panic.as_ref());
                    return std::task::Poll::Ready(Some(RequestMsg::WaitPanicked(text)));
                }
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// The placeholder deadline of an actor whose machine has none (it is never awaited).
const IDLE_SLEEP: Duration = Duration::from_secs(3600);

/// What a panic said.
fn panic_payload(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_string())
}

pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    format!("request actor failed: panicked: {}", panic_payload(panic))
}

enum Machine {
    Sender(SenderMachine),
    Receiver(ReceiverMachine),
}

pub(crate) struct RequestState {
    id: RequestId,
    role: Role,
    deed: Deed,
    link: Arc<dyn Link>,
    root: RootRef,
    machine: Machine,
    /// The machine's next deadline, which the actor's loop waits for beside its mailbox.
    timer: Option<Instant>,
    /// What the actor's loop waits for beside its mailbox: transfers in flight, lost
    /// writers' exits, the bootstrap lookup when the directory could not answer at once;
    /// each ends as the event it reports. Dropped with the actor.
    waits: Vec<Wait>,
    ended: bool,
    /// Decode: the prefill engine (and dp rank) this request receives from.
    prefill: Option<(EngineId, Option<u32>)>,
    metrics: Arc<Metrics>,
    /// `request{id, role, rank, peer}`: every log line of this actor, its transfers and its
    /// lookups is inside it (`peer`: the first peer the request deals with).
    span: Span,
    peer_named: std::cell::Cell<bool>,
    /// Blocks held in quarantine for a lost writer (counted in the metrics until released).
    quarantined: usize,
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl Drop for RequestState {
    /// Stopped, failed or done: nothing it started outlives it.
    fn drop(&mut self) {
        self.unquarantine();
    }
}

impl RequestState {
    fn start(myself: &RequestRef, args: RequestArgs) -> RequestState {
        let t = now();
        let span = tracing::info_span!(
            "request",
            id = %args.id,
            role = %args.role,
            rank = %args.link.me(),
            peer = tracing::field::Empty,
        );
        let _inside = span.clone().entered();
        let machine = match &args.kind {
            Kind::Sender => {
                let me = args.link.me();
                Machine::Sender(
                    SenderMachine::new(t, args.timeouts)
                        .fence_reads(args.link.one_sided())
                        .tp(me.tp_size, me.tp_rank),
                )
            }
            Kind::Receiver { mode, .. } => Machine::Receiver(
                ReceiverMachine::new(t, args.timeouts, *mode).fence_writes(args.link.one_sided()),
            ),
        };
        let mut state = RequestState {
            id: args.id,
            role: args.role,
            deed: args.deed,
            link: args.link,
            root: args.root,
            machine,
            timer: None,
            waits: Vec::new(),
            ended: false,
            prefill: None,
            metrics: args.metrics,
            span,
            peer_named: std::cell::Cell::new(false),
            quarantined: 0,
        };
        if let Kind::Receiver {
            prefill,
            prefill_dp_rank,
            ..
        } = args.kind
        {
            state.prefill = Some((prefill.clone(), prefill_dp_rank));
            // A push over a one-sided plane asks which writers the link could watch.
            let watch = state.pushes_one_sided();
            // A lookup the directory answers at once (its cache), and a link that knows its
            // peers already, need no task: the machine learns its peers before its first pump.
            let mut lookup = state.link.resolve(&prefill, prefill_dp_rank);
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let first = match lookup.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(Ok(peers)) => {
                    let mut check = unwatched(&state.link, &peers, watch);
                    match check.as_mut().poll(&mut cx) {
                        std::task::Poll::Ready(unwatched) => {
                            let event = ReceiverEvent::PeersResolved { peers, unwatched };
                            state.feed(t, MachineEvent::Receiver(event));
                            None
                        }
                        std::task::Poll::Pending => Some(Started::Checking(peers, check)),
                    }
                }
                std::task::Poll::Ready(Err(ResolveError::Fatal(reason))) => {
                    let event = ReceiverEvent::BootstrapFailed { reason };
                    state.feed(t, MachineEvent::Receiver(event));
                    None
                }
                std::task::Poll::Ready(Err(ResolveError::NotReady { .. })) => Some(Started::Again),
                std::task::Poll::Pending => Some(Started::Looking(lookup)),
            };
            if let Some(pending) = first {
                let deadline = t + args.timeouts.bootstrap;
                let lookup = resolve(
                    &state.link,
                    (prefill, prefill_dp_rank),
                    (pending, watch),
                    deadline,
                    state.span.clone(),
                );
                state.waits.push(lookup);
            }
        }
        for event in args.backlog {
            state.feed(t, event);
        }
        state.pump(myself);
        state
    }

    /// One message, synchronously (the span is entered for all of it).
    fn handle(&mut self, myself: &RequestRef, msg: RequestMsg) {
        let _inside = self.span.clone().entered();
        match msg {
            RequestMsg::Event(event) => self.feed(now(), event),
            RequestMsg::HandOver { event, blocks } => {
                // Taken by the estate (the root's, if it took the estate: then the
                // consignment is dropped and gives the blocks back).
                if let Some(Some(_)) = self.deed.with(|e| e.receive(blocks)) {
                    self.feed(now(), event);
                }
            }
            RequestMsg::Timeout => self.handle_timeout(now()),
            RequestMsg::Panic => panic!("injected fault in request {}", self.id),
            RequestMsg::WaitPanicked(text) => {
                panic!("request {}: a transfer or lookup panicked: {text}", self.id)
            }
        }
        self.pump(myself);
    }
}

impl RequestState {
    fn feed(&mut self, now: Instant, event: MachineEvent) {
        match (&mut self.machine, event) {
            // The peers the machine depends on (prefill: its decode rank once paired, from
            // transfer info or `Queued`; decode: every prefill rank once resolved) are
            // known to the runtime from then on, before this side sends them anything:
            // their loss must fail the request at once, not at a deadline.
            (Machine::Sender(m), MachineEvent::Sender(e)) => {
                m.handle(now, e);
                self.deed
                    .with(|estate| m.depends_on().for_each(|p| estate.add_peer(p)));
            }
            (Machine::Receiver(m), MachineEvent::Receiver(e)) => {
                m.handle(now, e);
                self.deed
                    .with(|estate| m.depends_on().for_each(|p| estate.add_peer(p)));
            }
            (_, event) => {
                warn!(request = %self.id, ?event, "event for the other side dropped")
            }
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        match &mut self.machine {
            Machine::Sender(m) => m.handle_timeout(now),
            Machine::Receiver(m) => m.handle_timeout(now),
        }
    }

    fn poll_action(&mut self) -> Option<Action> {
        match &mut self.machine {
            Machine::Sender(m) => m.poll_action(),
            Machine::Receiver(m) => m.poll_action(),
        }
    }

    fn poll_timeout(&self) -> Option<Instant> {
        match &self.machine {
            Machine::Sender(m) => m.poll_timeout(),
            Machine::Receiver(m) => m.poll_timeout(),
        }
    }

    /// Terminal, and nothing left in flight or held back: the root may stop this actor.
    fn settled(&self) -> bool {
        match &self.machine {
            Machine::Sender(m) => m.is_settled(),
            Machine::Receiver(m) => m.is_settled(),
        }
    }

    /// Performs every pending action, re-arms the timer, and reports the end.
    fn pump(&mut self, myself: &RequestRef) {
        while let Some(action) = self.poll_action() {
            match action {
                // The end and the release that comes with it reach the engine together.
                Action::StateChanged(end) if end.is_terminal() => match self.poll_action() {
                    Some(Action::Release { blocks, why }) => {
                        self.announce(&end);
                        self.estate(|e| e.end(end, &blocks, why));
                    }
                    next => {
                        self.perform(myself, Action::StateChanged(end));
                        if let Some(next) = next {
                            self.perform(myself, next);
                        }
                    }
                },
                action => self.perform(myself, action),
            }
        }
        self.arm();
        if self.settled() && !self.ended {
            self.ended = true;
            self.tell_unresolved_peers();
            // The root stops this actor; until then late events are absorbed by the machine.
            let state = match &self.machine {
                Machine::Sender(m) => m.state().clone(),
                Machine::Receiver(m) => m.state().clone(),
            };
            let _ = self.root.cast(RootMsg::Ended {
                id: self.id.clone(),
                state,
            });
        }
    }

    /// A decode request that failed before it knew its prefill ranks could tell none of them
    /// (found by the simulator: prefill then waited out its whole bootstrap timeout). Look
    /// them up once more, briefly, and tell them; best effort, bounded by
    /// [`ABORT_LOOKUP_TIMEOUT`].
    fn tell_unresolved_peers(&self) {
        let (Machine::Receiver(m), Some((prefill, dp))) = (&self.machine, &self.prefill) else {
            return;
        };
        let State::Failed(reason) = m.state().clone() else {
            return;
        };
        if m.peers().next().is_some() {
            return; // the machine told them itself
        }
        let (link, id, lookup) = (
            self.link.clone(),
            self.id.clone(),
            self.link.resolve(prefill, *dp),
        );
        tokio::spawn(async move {
            if let Ok(Ok(peers)) = tokio::time::timeout(ABORT_LOOKUP_TIMEOUT, lookup).await {
                for peer in peers {
                    let _ = link.send(
                        &peer,
                        &id,
                        crate::machine::PeerMessage::Abort {
                            reason: reason.clone(),
                        },
                    );
                }
            }
        });
    }

    /// Runs `f` on the estate while this actor owns it (the root takes it only once the
    /// actor is gone, or the runtime stops: then there is nothing left to record).
    fn estate(&self, f: impl FnOnce(&mut Estate)) {
        if self.deed.with(f).is_none() {
            debug!(request = %self.id, "the estate was taken: the runtime is stopping");
        }
    }

    fn perform(&mut self, myself: &RequestRef, action: Action) {
        let id = &self.id;
        match action {
            Action::Send { to, msg } => {
                self.name_peer(&to);
                self.deed.with(|e| e.add_peer(&to));
                if let Err(e) = self.link.send(&to, id, msg) {
                    debug!(request = %id, peer = %to, error = %e, "send failed: peer lost");
                    let what = Local::PeerLost { peer: to };
                    let event = MachineEvent::for_role(self.role, what);
                    // Delivered as a message so this pump's actions stay in order.
                    let _ = myself.cast(RequestMsg::Event(event));
                }
            }
            Action::Write {
                to,
                src,
                dst,
                deadline,
            } => {
                self.name_peer(&to);
                self.deed.with(|e| e.add_peer(&to));
                let n = src.len();
                let fut = self.link.write(id, &to, src, dst, deadline);
                let done = move |r: Result<(), TransferError>| match r {
                    Ok(()) => SenderEvent::TransferComplete { to },
                    Err(e) => SenderEvent::TransferFailed {
                        to,
                        detail: e.to_string(),
                    },
                };
                self.start_transfer(fut, ("write", n), deadline, move |r| {
                    MachineEvent::Sender(done(r))
                });
            }
            Action::Read {
                from,
                src,
                dst,
                deadline,
            } => {
                let n = dst.len();
                let fut = self.link.read(id, &from, src, dst, deadline);
                let done = move |r: Result<(), TransferError>| match r {
                    Ok(()) => ReceiverEvent::ReadComplete { from },
                    Err(e) => ReceiverEvent::TransferFailed {
                        detail: e.to_string(),
                    },
                };
                self.start_transfer(fut, ("read", n), deadline, move |r| {
                    MachineEvent::Receiver(done(r))
                });
            }
            Action::Quarantine {
                peers,
                blocks,
                replaced,
            } => self.quarantine(peers, blocks, &replaced),
            Action::WatchEarlier { peer } => {
                if !self.watch(peer.clone(), true) {
                    debug!(request = %self.id, %peer, "no earlier process of this rank to watch");
                }
            }
            Action::PullsInstead { unwatched } => {
                debug!(request = %id, peers = ?unwatched, "push runs as pull: these prefill ranks cannot be watched should they be lost as writers (another host), so a late write could not be fenced");
                self.metrics.pulls_instead();
            }
            Action::Unconfirmed { from } => {
                warn!(request = %id, peer = %from, "a confirmation from this rank's new process ends nothing: the lost one may still write into these blocks, and they are held until it exits");
                self.metrics.refused(crate::router::REPLACED_WRITER);
            }
            Action::Release { blocks, why } => {
                self.unquarantine();
                self.estate(|e| e.release(&blocks, why))
            }
            Action::Aux { from, bytes } => self.estate(|e| e.add_aux(from, bytes)),
            Action::StateChanged(state) => {
                self.announce(&state);
                self.estate(|e| e.transition(state));
            }
        }
    }

    /// The fence bound passed with lost writers unconfirmed (push over a one-sided plane):
    /// watch each one's process where the link can, and hold the blocks until it exits or
    /// confirms; one the link cannot watch is let go on the bound, as before.
    fn quarantine(
        &mut self,
        peers: Vec<crate::machine::Peer>,
        blocks: usize,
        replaced: &[crate::machine::Peer],
    ) {
        let mut watched = Vec::new();
        for peer in peers {
            if self.watch(peer.clone(), replaced.contains(&peer)) {
                watched.push(peer.to_string());
            } else {
                let event = ReceiverEvent::WriterGone {
                    peer,
                    exited: false,
                };
                self.feed(now(), MachineEvent::Receiver(event));
            }
        }
        if !watched.is_empty() {
            warn!(request = %self.id, writers = ?watched, blocks, "quarantined: a lost writer on this host may still land one write in these blocks when it resumes; they are held until it exits or confirms");
            self.quarantined = blocks;
            self.metrics.quarantined(self.role, blocks as i64);
        }
    }

    /// Watches the process(es) of `peer` that may still write into our blocks
    /// ([`Link::writer_exit`]): the machine hears `WriterGone` once they have exited. False
    /// when the link cannot watch them.
    fn watch(&mut self, peer: crate::machine::Peer, replaced: bool) -> bool {
        let Some(exit) = self.link.writer_exit(&peer, replaced) else {
            return false;
        };
        self.waits.push(Box::pin(async move {
            exit.await;
            Some(MachineEvent::Receiver(ReceiverEvent::WriterGone {
                peer,
                exited: true,
            }))
        }));
        true
    }

    /// The quarantined blocks go (or the actor is gone): the gauge forgets them.
    fn unquarantine(&mut self) {
        let n = std::mem::take(&mut self.quarantined);
        if n > 0 {
            self.metrics.quarantined(self.role, -(n as i64));
        }
    }

    /// Names the request's first peer in its span.
    fn name_peer(&self, peer: &crate::machine::Peer) {
        if !self.peer_named.replace(true) {
            self.span.record("peer", tracing::field::display(peer));
        }
    }

    /// Logs a state change; at the end, revokes remote access before the estate releases
    /// the blocks.
    fn announce(&self, state: &State) {
        let id = &self.id;
        debug!(request = %id, role = %self.role, %state, "state changed");
        if state.is_terminal() {
            self.link.request_ended(id);
        }
    }

    /// Runs a transfer and reports its outcome to the machine. The plane answers by the
    /// transfer's deadline (`Link::write`); this waits [`PLANE_ANSWER_GRACE`] past it
    /// before reporting a failure itself, which only a stuck plane makes it do. The
    /// transfer is polled by the actor's own loop (no task of its own): its answer is the
    /// next message.
    fn start_transfer(
        &mut self,
        fut: crate::link::TransferFuture,
        (op, blocks): (&'static str, usize),
        deadline: Instant,
        report: impl FnOnce(Result<(), TransferError>) -> MachineEvent + Send + 'static,
    ) {
        let id = self.id.clone();
        let until = tokio::time::Instant::from_std(deadline) + PLANE_ANSWER_GRACE;
        let (metrics, transport) = (self.metrics.clone(), self.link.transport());
        self.waits.push(Box::pin(async move {
            let posted = tokio::time::Instant::now();
            let result = match tokio::time::timeout_at(until, fut).await {
                Ok(r) => r,
                Err(_) => {
                    warn!(request = %id, grace = ?PLANE_ANSWER_GRACE, "the data plane did not answer by the transfer's deadline");
                    Err(TransferError::Unanswered {
                        grace: PLANE_ANSWER_GRACE,
                    })
                }
            };
            let took = posted.elapsed();
            metrics.transfer(transport, op, blocks, took, result.is_ok());
            debug!(op, blocks, ?took, ok = result.is_ok(), "transfer answered");
            Some(report(result))
        }.instrument(self.span.clone())));
    }

    /// Decode, push, over a plane whose writes decode's side cannot refuse: the request asks
    /// the link which writers it could watch before its transfer info goes out.
    fn pushes_one_sided(&self) -> bool {
        matches!(&self.machine, Machine::Receiver(m) if m.mode() == TransferMode::Push)
            && self.link.one_sided()
    }

    /// The deadline the actor's loop waits for next: the machine's.
    fn arm(&mut self) {
        self.timer = self.poll_timeout();
    }
}

/// Which of `peers` the link could not watch (`Link::unwatched`), asked only with `watch`
/// (a push over a one-sided plane); otherwise none, answered at once.
fn unwatched(
    link: &Arc<dyn Link>,
    peers: &[crate::machine::Peer],
    watch: bool,
) -> crate::link::UnwatchedFuture {
    if watch {
        link.unwatched(peers)
    } else {
        Box::pin(std::future::ready(Vec::new()))
    }
}

/// How far a decode request's resolution got before it needed a task.
enum Started {
    /// The lookup, still pending.
    Looking(crate::link::ResolveFuture),
    /// The lookup answered "not ready": wait, then ask again.
    Again,
    /// The peers are known; which of them the link could watch is not yet.
    Checking(Vec<crate::machine::Peer>, crate::link::UnwatchedFuture),
}

/// Asks the bootstrap for the prefill ranks until it answers, fails for good, or the
/// bootstrap deadline passes (then it ends with nothing, and the machine's own deadline
/// fails the request), starting from where the first try got: a wait of the actor's loop.
/// With `watch` (a push over a one-sided plane), the answer waits for the link to say which
/// of them it could not watch (`Link::unwatched`).
fn resolve(
    link: &Arc<dyn Link>,
    (prefill, dp_rank): (EngineId, Option<u32>),
    (first, watch): (Started, bool),
    deadline: Instant,
    span: Span,
) -> Wait {
    let link = link.clone();
    let deadline = tokio::time::Instant::from_std(deadline);
    let lookup = async move {
        let mut backoff = RESOLVE_BACKOFF_MIN;
        let mut first = match first {
            Started::Checking(peers, check) => {
                let unwatched = tokio::time::timeout_at(deadline, check).await.ok()?;
                return Some(ReceiverEvent::PeersResolved { peers, unwatched });
            }
            Started::Looking(lookup) => Some(lookup),
            Started::Again => {
                if tokio::time::Instant::now() + backoff >= deadline {
                    return None;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RESOLVE_BACKOFF_MAX);
                None
            }
        };
        loop {
            let lookup = first
                .take()
                .unwrap_or_else(|| link.resolve(&prefill, dp_rank));
            match tokio::time::timeout_at(deadline, lookup).await.ok()? {
                Ok(peers) => {
                    let check = unwatched(&link, &peers, watch);
                    let unwatched = tokio::time::timeout_at(deadline, check).await.ok()?;
                    return Some(ReceiverEvent::PeersResolved { peers, unwatched });
                }
                Err(ResolveError::Fatal(reason)) => {
                    return Some(ReceiverEvent::BootstrapFailed { reason })
                }
                Err(ResolveError::NotReady { detail }) => {
                    debug!(%prefill, %detail, "bootstrap not ready; asking again");
                    if tokio::time::Instant::now() + backoff >= deadline {
                        return None;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RESOLVE_BACKOFF_MAX);
                }
            }
        }
    };
    Box::pin(async move { lookup.await.map(MachineEvent::Receiver) }.instrument(span))
}
