//! [`Worker`], [`Endpoint`], [`RemoteKey`], and waiting on UCX requests with a deadline.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::rc::{Rc, Weak};
use std::time::Instant;

use super::context::{Context, ContextInner, ContextOptions};
use super::maps;
use super::rkey;
use super::sys::{self, Api};
use super::{UcxError, ENDPOINT_CLOSE_TIMEOUT, RKEY_BYTES_MAX, WORKER_ADDRESS_BYTES_MAX};

/// Idle `ucp_worker_progress` calls (returning 0) between two `yield_now`s while waiting:
/// spinning keeps latency in microseconds, yielding now and then lets a peer sharing the
/// core (two-core CI machines, an in-process test peer) make progress too.
const IDLE_SPINS_PER_YIELD: u32 = 64;

/// Where UCX's error handler records an endpoint's failure. Boxed so its address is stable
/// for the C callback; lives until the endpoint is closed (or, if a close never completed,
/// until the worker is destroyed).
struct ErrSlot {
    status: Cell<sys::ucs_status_t>,
}

/// `ucp_err_handler_cb_t`: records the failure; the next operation force-closes the endpoint.
unsafe extern "C" fn on_endpoint_error(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    // SAFETY: `arg` is the `ErrSlot` we registered with the endpoint; it outlives every
    // callback (see `ErrSlot`); called on the worker's thread from inside progress.
    let slot = unsafe { &*(arg as *const ErrSlot) };
    if slot.status.get() == sys::UCS_OK {
        slot.status.set(status);
    }
}

// Boxed error slots in `graveyard`: UCX holds each slot's address, so they must not move.
#[allow(clippy::vec_box)]
pub(crate) struct WorkerInner {
    pub(crate) api: &'static Api,
    pub(crate) ctx: Rc<ContextInner>,
    pub(crate) handle: sys::ucp_worker_h,
    /// Error slots of endpoints whose close did not complete: UCX may still call back into
    /// them until `ucp_worker_destroy`.
    graveyard: RefCell<Vec<Box<ErrSlot>>>,
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        // SAFETY: `handle` came from `ucp_worker_create`; every endpoint holds an `Rc` to
        // this inner, so all are gone; the context outlives us through `ctx`.
        unsafe { (self.api.ucp_worker_destroy)(self.handle) };
    }
}

impl WorkerInner {
    fn progress(&self) -> u32 {
        // SAFETY: live worker, driven only from this thread (handles are `!Send`).
        unsafe { (self.api.ucp_worker_progress)(self.handle) }
    }

    /// Waits for a `ucs_status_ptr_t` from an `_nbx` call: progresses the worker until the
    /// request completes or `deadline` passes. The request is always freed.
    pub(crate) fn wait(
        &self,
        op: &'static str,
        ptr: sys::ucs_status_ptr_t,
        deadline: Instant,
    ) -> Result<(), UcxError> {
        let request = match self.poll_start(op, ptr)? {
            None => return Ok(()),
            Some(request) => request,
        };
        let started = Instant::now();
        let mut idle = 0u32;
        loop {
            if let Some(result) = self.poll(op, request) {
                return result;
            }
            if Instant::now() >= deadline {
                self.free(request);
                return Err(UcxError::Timeout {
                    op,
                    after: started.elapsed(),
                });
            }
            self.progress_or_yield(&mut idle);
        }
    }

    /// Interprets an `_nbx` return: `Ok(None)` done, `Ok(Some(request))` in flight.
    pub(crate) fn poll_start(
        &self,
        op: &'static str,
        ptr: sys::ucs_status_ptr_t,
    ) -> Result<Option<*mut c_void>, UcxError> {
        if ptr.is_null() {
            Ok(None)
        } else if sys::ptr_is_err(ptr) {
            Err(self.api.error(op, sys::ptr_status(ptr)))
        } else {
            Ok(Some(ptr))
        }
    }

    /// Checks a request once: `None` while in flight, else its result (request freed).
    pub(crate) fn poll(
        &self,
        op: &'static str,
        request: *mut c_void,
    ) -> Option<Result<(), UcxError>> {
        // SAFETY: `request` is a live request handle returned by an `_nbx` call and not
        // yet freed (we free it exactly once, below or in `free`).
        let status = unsafe { (self.api.ucp_request_check_status)(request) };
        if status == sys::UCS_INPROGRESS {
            return None;
        }
        self.free(request);
        Some(self.api.check(op, status))
    }

    /// Releases a request; one still in flight is released by UCX when it completes.
    pub(crate) fn free(&self, request: *mut c_void) {
        // SAFETY: live, not yet freed request (callers free each request once).
        unsafe { (self.api.ucp_request_free)(request) };
    }

    pub(crate) fn progress_or_yield(&self, idle: &mut u32) {
        if self.progress() == 0 {
            *idle += 1;
            if *idle >= IDLE_SPINS_PER_YIELD {
                *idle = 0;
                std::thread::yield_now();
            }
        } else {
            *idle = 0;
        }
    }
}

/// A UCP worker in single-thread mode: the progress engine that endpoints and operations
/// run on.
///
/// Created from a [`Context`]; its [`Worker::address`] goes to peers over the control
/// plane, and [`Worker::connect`] turns a peer's address into an [`Endpoint`]. Operations
/// progress it while they wait; a worker that only serves as an RMA target (its memory is
/// written by peers) must still call [`Worker::progress`] regularly, since some transports
/// (TCP, wireup of new endpoints) need the target side to progress.
#[derive(Clone)]
pub struct Worker {
    pub(crate) inner: Rc<WorkerInner>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("handle", &self.inner.handle)
            .finish()
    }
}

/// Attempts at a context and its worker when an interface the context listed is gone by
/// the time the worker opens it ([`Worker::open`]).
pub const OPEN_ATTEMPTS: u32 = 3;

impl Worker {
    /// A context made with `options` and a single-thread-mode worker on it.
    ///
    /// `ucp_init` lists the host's network interfaces and `ucp_worker_create` opens each
    /// one: an interface removed (or left without an address) in between fails the worker
    /// with `UCS_ERR_NO_DEVICE`. Hosts whose interfaces come and go (containers, network
    /// namespaces made and removed) open that window, so the context is made again, up to
    /// `OPEN_ATTEMPTS` (3) times in all; any other failure is returned at once.
    pub fn open(options: &ContextOptions) -> Result<(Context, Worker), UcxError> {
        Self::open_with(options, |_| {})
    }

    /// [`Worker::open`], calling `between(attempt)` after each context is made and before
    /// its worker (tests change the host's interfaces there).
    #[doc(hidden)]
    pub fn open_with(
        options: &ContextOptions,
        mut between: impl FnMut(u32),
    ) -> Result<(Context, Worker), UcxError> {
        let mut attempt = 1;
        loop {
            let ctx = Context::with_options(options)?;
            between(attempt);
            match Worker::new(&ctx) {
                Ok(worker) => return Ok((ctx, worker)),
                Err(UcxError::Status { code, .. })
                    if code == i32::from(sys::UCS_ERR_NO_DEVICE) && attempt < OPEN_ATTEMPTS =>
                {
                    tracing::warn!(
                        attempt,
                        "a network interface UCX listed went away before its worker opened it; listing again"
                    );
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Creates a single-thread-mode worker on `ctx`.
    pub fn new(ctx: &Context) -> Result<Self, UcxError> {
        let api = ctx.inner.api;
        // SAFETY: an all-zero `ucp_worker_params_t` is valid (integers, nulls, empty mask).
        let mut params: sys::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        params.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        let mut handle = std::ptr::null_mut();
        // SAFETY: live context; 1.13-layout params with only 1.13 fields flagged.
        let status = unsafe { (api.ucp_worker_create)(ctx.inner.handle, &params, &mut handle) };
        api.check("ucp_worker_create", status)?;
        Ok(Self {
            inner: Rc::new(WorkerInner {
                api,
                ctx: Rc::clone(&ctx.inner),
                handle,
                graveyard: RefCell::new(Vec::new()),
            }),
        })
    }

    /// The worker's event file descriptor (its context made with
    /// [`ContextOptions::wakeup`](super::ContextOptions::wakeup)): it becomes readable when
    /// the worker has something to progress, once [`Worker::arm`] armed it. Owned by the
    /// worker: valid while it lives, never to be closed.
    pub fn event_fd(&self) -> Result<std::os::fd::RawFd, UcxError> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: live worker; `fd` is written on OK.
        let status = unsafe { (self.inner.api.ucp_worker_get_efd)(self.inner.handle, &mut fd) };
        self.inner.api.check("ucp_worker_get_efd", status)?;
        Ok(fd)
    }

    /// Arms the event fd for the next event. True: armed, nothing pending, so blocking on
    /// [`Worker::event_fd`] is safe; false: events are pending, progress first.
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: live worker made on a context with wakeup support (else UCX says so).
        let status = unsafe { (self.inner.api.ucp_worker_arm)(self.inner.handle) };
        if status == sys::UCS_ERR_BUSY {
            return Ok(false);
        }
        self.inner.api.check("ucp_worker_arm", status)?;
        Ok(true)
    }

    /// This worker's address, to send to peers that will [`Worker::connect`] to it.
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let api = self.inner.api;
        let mut address = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live worker; valid out-parameters.
        let status =
            unsafe { (api.ucp_worker_get_address)(self.inner.handle, &mut address, &mut len) };
        api.check("ucp_worker_get_address", status)?;
        // SAFETY: on OK, `address` holds `len` bytes until released below.
        let bytes = unsafe { std::slice::from_raw_parts(address.cast::<u8>(), len) }.to_vec();
        // SAFETY: released once, after copying.
        unsafe { (api.ucp_worker_release_address)(self.inner.handle, address) };
        Ok(bytes)
    }

    /// Runs UCX's progress engine once; returns how many events it handled.
    pub fn progress(&self) -> u32 {
        self.inner.progress()
    }

    /// Progresses the worker until `deadline`, for a target that must stay responsive.
    pub fn progress_until(&self, deadline: Instant) {
        let mut idle = 0;
        while Instant::now() < deadline {
            self.inner.progress_or_yield(&mut idle);
        }
    }

    /// Flushes every endpoint of the worker (`ucp_worker_flush_nbx`): all puts are complete
    /// at their targets when this returns `Ok`.
    pub fn flush(&self, deadline: Instant) -> Result<(), UcxError> {
        let param = sys::ucp_request_param_t::empty();
        // SAFETY: live worker; `param` with an empty mask.
        let ptr = unsafe { (self.inner.api.ucp_worker_flush_nbx)(self.inner.handle, &param) };
        self.inner.wait("ucp_worker_flush_nbx", ptr, deadline)
    }

    /// Connects to a peer's worker address (from its [`Worker::address`]), with
    /// peer-failure error handling: a dead peer fails operations instead of hanging them.
    ///
    /// The address bytes come from the control plane; UCX parses them, so only pass
    /// addresses from authenticated peers. Lengths are bounded by
    /// [`WORKER_ADDRESS_BYTES_MAX`].
    pub fn connect(&self, remote_address: &[u8]) -> Result<Endpoint, UcxError> {
        if remote_address.is_empty() || remote_address.len() > WORKER_ADDRESS_BYTES_MAX {
            return Err(UcxError::InvalidArgument {
                what: format!(
                    "worker address of {} bytes (expected 1..={WORKER_ADDRESS_BYTES_MAX})",
                    remote_address.len()
                ),
            });
        }
        let api = self.inner.api;
        let slot = Box::new(ErrSlot {
            status: Cell::new(sys::UCS_OK),
        });
        // SAFETY: an all-zero `ucp_ep_params_t` is valid (integers, nulls, `None`).
        let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER;
        params.address = remote_address.as_ptr().cast();
        params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
        params.err_handler = sys::ucp_err_handler_t {
            cb: Some(on_endpoint_error),
            arg: (&*slot as *const ErrSlot).cast_mut().cast(),
        };
        let mut handle = std::ptr::null_mut();
        // SAFETY: live worker; the address bytes outlive the call (UCX copies what it
        // needs); the error slot outlives the endpoint (see `ErrSlot`).
        let status = unsafe { (api.ucp_ep_create)(self.inner.handle, &params, &mut handle) };
        api.check("ucp_ep_create", status)?;
        Ok(Endpoint {
            inner: Rc::new(EndpointInner {
                worker: Rc::clone(&self.inner),
                handle: Cell::new(handle),
                slot: RefCell::new(Some(slot)),
                closed: RefCell::new(None),
                rkeys: RefCell::new(Vec::new()),
            }),
        })
    }
}

pub(crate) struct EndpointInner {
    pub(crate) worker: Rc<WorkerInner>,
    handle: Cell<sys::ucp_ep_h>,
    slot: RefCell<Option<Box<ErrSlot>>>,
    /// Why the endpoint was force-closed, once it was.
    closed: RefCell<Option<UcxError>>,
    /// Keys unpacked on this endpoint: UCX requires them destroyed before the endpoint is.
    rkeys: RefCell<Vec<Weak<RkeyInner>>>,
}

impl EndpointInner {
    /// The live handle, or the error that closed it. Notices a failure the error handler
    /// recorded and force-closes the endpoint then.
    pub(crate) fn live(&self) -> Result<sys::ucp_ep_h, UcxError> {
        if let Some(reason) = self.closed.borrow().as_ref() {
            return Err(UcxError::EndpointClosed {
                reason: Box::new(reason.clone()),
            });
        }
        let failed = self
            .slot
            .borrow()
            .as_ref()
            .map_or(sys::UCS_OK, |s| s.status.get());
        if failed != sys::UCS_OK {
            let error = UcxError::EndpointFailed {
                code: i32::from(failed),
                message: self.worker.api.status_string(failed),
            };
            self.fail(error.clone());
            return Err(error);
        }
        Ok(self.handle.get())
    }

    /// Force-closes the endpoint after `error` (a peer failure or a timeout): UCX cancels
    /// every operation still in flight, so none touches our memory afterwards.
    pub(crate) fn fail(&self, error: UcxError) {
        if self.closed.borrow().is_some() {
            return;
        }
        tracing::warn!(%error, "UCX endpoint force-closed");
        *self.closed.borrow_mut() = Some(error);
        self.close(true, Instant::now() + ENDPOINT_CLOSE_TIMEOUT);
    }

    fn close(&self, force: bool, deadline: Instant) {
        let handle = self.handle.replace(std::ptr::null_mut());
        if handle.is_null() {
            return;
        }
        self.destroy_rkeys();
        let mut param = sys::ucp_request_param_t::empty();
        if force {
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: live endpoint, closed exactly once (handle swapped to null above); its
        // remote keys were destroyed first, as UCX requires.
        let ptr = unsafe { (self.worker.api.ucp_ep_close_nbx)(handle, &param) };
        match self.worker.wait("ucp_ep_close_nbx", ptr, deadline) {
            Ok(()) => {}
            Err(UcxError::Timeout { .. }) => {
                tracing::warn!(
                    force,
                    "UCX endpoint close timed out; worker destroy releases it"
                );
                if let Some(slot) = self.slot.borrow_mut().take() {
                    self.worker.graveyard.borrow_mut().push(slot);
                }
            }
            // A close that fails (e.g. the peer is gone) still releases the endpoint.
            Err(error) => tracing::debug!(%error, "UCX endpoint close reported an error"),
        }
    }

    fn destroy_rkeys(&self) {
        for rkey in self.rkeys.borrow_mut().drain(..) {
            if let Some(rkey) = rkey.upgrade() {
                rkey.destroy();
            }
        }
    }
}

impl Drop for EndpointInner {
    fn drop(&mut self) {
        let failed = self
            .slot
            .borrow()
            .as_ref()
            .is_some_and(|s| s.status.get() != sys::UCS_OK);
        self.close(failed, Instant::now() + ENDPOINT_CLOSE_TIMEOUT);
    }
}

/// A connection to one peer worker, made by [`Worker::connect`].
///
/// Carries the RMA operations ([`Endpoint::put`], [`Endpoint::get`],
/// [`Endpoint::transfer`]) and [`Endpoint::flush`]. After a peer failure or a timeout it is
/// force-closed and every later call returns [`UcxError::EndpointClosed`]. Dropping it
/// closes it gracefully within [`ENDPOINT_CLOSE_TIMEOUT`].
pub struct Endpoint {
    pub(crate) inner: Rc<EndpointInner>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("handle", &self.inner.handle.get())
            .field("closed", &self.inner.closed.borrow())
            .finish()
    }
}

/// What is checked of a peer's key before UCX sees it: its size, its range, its format.
fn check_key(packed: &[u8], base: u64, len: u64) -> Result<rkey::KeyShape, UcxError> {
    if packed.is_empty() || packed.len() > RKEY_BYTES_MAX {
        return Err(UcxError::InvalidArgument {
            what: format!(
                "remote key of {} bytes (expected 1..={RKEY_BYTES_MAX})",
                packed.len()
            ),
        });
    }
    if base.checked_add(len).is_none() {
        return Err(UcxError::OutOfRange {
            what: "remote region",
            offset: base,
            len,
            limit: u64::MAX,
        });
    }
    rkey::check_format(packed).map_err(|e| UcxError::MalformedKey {
        detail: e.to_string(),
    })
}

impl Endpoint {
    /// Turns a peer's packed remote key (from its [`super::MemoryRegion::pack_rkey`]) into a
    /// [`RemoteKey`] for the peer's region `[base, base + len)`: [`Endpoint::unpack_rkeys`]
    /// for one key.
    pub fn unpack_rkey(&self, packed: &[u8], base: u64, len: u64) -> Result<RemoteKey, UcxError> {
        self.unpack_rkeys(&[(packed, base, len)])
            .map(|mut keys| keys.remove(0))
            .map_err(|(_, e)| e)
    }

    /// Turns a peer's packed remote keys, each with the region `[base, base + len)` it is
    /// advertised for, into [`RemoteKey`]s. Every operation through a key is checked against
    /// its range before it is posted. `Err` names the index of the key refused; nothing of
    /// the others is kept.
    ///
    /// No bytes from a peer can make this process take a signal in UCX (see `rkey`):
    /// - a key is walked before UCX sees it, every domain inside its bytes and a memory
    ///   type this runtime moves, else [`UcxError::MalformedKey`]; UCX gets it padded;
    /// - where the loaded UCX (before 1.19) dies when one domain of a key fails to unpack,
    ///   the host keys are unpacked first in a forked child, and a key that kills it (or
    ///   that UCX refuses) is [`UcxError::MalformedKey`]; a child that stalls is followed
    ///   by one more (a lock held at the fork stalls one child, not the next), and a
    ///   vetting still unanswered at its bound is [`UcxError::KeysUndecided`];
    /// - where UCX reaches the key's memory by pointer (the shared-memory transports, whose
    ///   puts and gets are an unbounded `memcpy` into a mapping of the peer's segment), the
    ///   range must lie inside the mapping this unpacking made, else
    ///   [`UcxError::UnverifiedKey`] and the key is destroyed: a peer cannot make us touch
    ///   memory outside what it registered by advertising a range its key does not cover.
    pub fn unpack_rkeys(
        &self,
        keys: &[(&[u8], u64, u64)],
    ) -> Result<Vec<RemoteKey>, (usize, UcxError)> {
        let mut padded = Vec::with_capacity(keys.len());
        let mut host = Vec::new();
        for (i, &(packed, base, len)) in keys.iter().enumerate() {
            let shape = check_key(packed, base, len).map_err(|e| (i, e))?;
            padded.push(rkey::padded(packed));
            if shape.memory_type == rkey::MEMORY_TYPE_HOST {
                host.push(i);
            }
        }
        let api = self.inner.worker.api;
        // Held until every key is unpacked here: what the child attached stays attached.
        let _held = if rkey::needs_vetting(api.version) && !host.is_empty() {
            let ep = self.inner.live().map_err(|e| (host[0], e))?;
            let vetted: Vec<&[u8]> = host.iter().map(|&i| padded[i].as_slice()).collect();
            let started = Instant::now();
            let vetting = rkey::vet_again_once(started, |by| rkey::vet(api, ep, &vetted, by));
            let held = vetting.map_err(|e| {
                // Which key: the child does not say; the first host key stands for them.
                let error = match e {
                    rkey::VetError::Refused(detail) => UcxError::MalformedKey { detail },
                    rkey::VetError::Undecided(detail) => UcxError::KeysUndecided { detail },
                    rkey::VetError::Unavailable(detail) => UcxError::InvalidArgument {
                        what: format!("remote keys not vetted: {detail}"),
                    },
                };
                (host[0], error)
            })?;
            tracing::debug!(
                keys = host.len(),
                took_us = started.elapsed().as_micros() as u64,
                "peer's remote keys vetted in a child process"
            );
            Some(held)
        } else {
            None
        };
        let mut out = Vec::with_capacity(keys.len());
        for (i, (&(_, base, len), bytes)) in keys.iter().zip(&padded).enumerate() {
            out.push(self.unpack_checked(bytes, base, len).map_err(|e| (i, e))?);
        }
        Ok(out)
    }

    /// Unpacks one key whose format was checked (and padded), then checks its reach.
    fn unpack_checked(&self, packed: &[u8], base: u64, len: u64) -> Result<RemoteKey, UcxError> {
        let ep = self.inner.live()?;
        let api = self.inner.worker.api;
        let mut handle = std::ptr::null_mut();
        // Snapshot, unpack, snapshot, under one process-wide lock: the shared mappings new
        // between the two are the ones this unpacking made (see `maps`).
        let guard = maps::hold();
        let before = maps::shared();
        // SAFETY: live endpoint; `packed` outlives the call (UCX copies what it needs).
        let status = unsafe { (api.ucp_ep_rkey_unpack)(ep, packed.as_ptr().cast(), &mut handle) };
        api.check("ucp_ep_rkey_unpack", status)?;
        let checked = verify_reach(api, handle, base, len, before);
        drop(guard);
        if let Err(detail) = checked {
            // SAFETY: `handle` came from `ucp_ep_rkey_unpack` above and is destroyed once.
            unsafe { (api.ucp_rkey_destroy)(handle) };
            return Err(UcxError::UnverifiedKey { base, len, detail });
        }
        let inner = Rc::new(RkeyInner {
            api,
            handle: Cell::new(handle),
            _ep: Rc::clone(&self.inner),
            base,
            len,
        });
        let mut rkeys = self.inner.rkeys.borrow_mut();
        rkeys.retain(|k| k.strong_count() > 0);
        rkeys.push(Rc::downgrade(&inner));
        Ok(RemoteKey { inner })
    }

    /// Flushes the endpoint (`ucp_ep_flush_nbx`): every put is complete at the target when
    /// this returns `Ok`. A timeout force-closes the endpoint.
    pub fn flush(&self, deadline: Instant) -> Result<(), UcxError> {
        let ep = self.inner.live()?;
        let param = sys::ucp_request_param_t::empty();
        // SAFETY: live endpoint; `param` with an empty mask.
        let ptr = unsafe { (self.inner.worker.api.ucp_ep_flush_nbx)(ep, &param) };
        self.inner
            .worker
            .wait("ucp_ep_flush_nbx", ptr, deadline)
            .inspect_err(|e| self.inner.fail(e.clone()))?;
        // A failure noticed while flushing (peer died) must not read as success.
        self.inner.live().map(|_| ())
    }

    /// Closes the endpoint now (gracefully, within `deadline`), instead of on drop.
    /// Remote keys unpacked on it become unusable.
    pub fn close(self, deadline: Instant) {
        let failed = self
            .inner
            .slot
            .borrow()
            .as_ref()
            .is_some_and(|s| s.status.get() != sys::UCS_OK);
        self.inner.close(failed, deadline);
        if self.inner.closed.borrow().is_none() {
            *self.inner.closed.borrow_mut() = Some(UcxError::ClosedByOwner);
        }
    }

    /// The failure that closed this endpoint, if it was force-closed (also notices a peer
    /// failure recorded since the last operation).
    pub fn error(&self) -> Option<UcxError> {
        match self.inner.live() {
            Ok(_) => None,
            Err(UcxError::EndpointClosed { reason }) => Some(*reason),
            Err(error) => Some(error),
        }
    }
}

pub(crate) struct RkeyInner {
    api: &'static Api,
    handle: Cell<sys::ucp_rkey_h>,
    /// UCX requires the endpoint to outlive the key.
    _ep: Rc<EndpointInner>,
    pub(crate) base: u64,
    pub(crate) len: u64,
}

impl RkeyInner {
    fn destroy(&self) {
        let handle = self.handle.replace(std::ptr::null_mut());
        if !handle.is_null() {
            // SAFETY: `handle` came from `ucp_ep_rkey_unpack`, destroyed once (swapped to
            // null), before its endpoint (which `_ep` keeps alive) is closed.
            unsafe { (self.api.ucp_rkey_destroy)(handle) };
        }
    }

    /// The live handle, or `None` after the endpoint's force-close destroyed it.
    pub(crate) fn handle(&self) -> Option<sys::ucp_rkey_h> {
        let handle = self.handle.get();
        (!handle.is_null()).then_some(handle)
    }
}

impl Drop for RkeyInner {
    fn drop(&mut self) {
        self.destroy();
    }
}

/// A peer's memory region as seen through one [`Endpoint`] (`ucp_ep_rkey_unpack`), with
/// the region's bounds: operations outside `[base, base + len)` are refused with
/// [`UcxError::OutOfRange`] before anything is posted. Keeps its endpoint alive.
pub struct RemoteKey {
    pub(crate) inner: Rc<RkeyInner>,
}

impl std::fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKey")
            .field("base", &self.inner.base)
            .field("len", &self.inner.len)
            .finish_non_exhaustive()
    }
}

impl RemoteKey {
    /// Start address of the remote region.
    pub fn base(&self) -> u64 {
        self.inner.base
    }

    /// Length of the remote region in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// Whether the remote region is empty (then every operation is out of range).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    pub(crate) fn belongs_to(&self, ep: &Endpoint) -> bool {
        Rc::ptr_eq(&self.inner._ep, &ep.inner)
    }
}

/// Checks that a key just unpacked opens `[base, base + len)`, where UCX reaches it by
/// pointer (the shared-memory transports, which put and get with `memcpy` at
/// `mapping + address - segment base`, unchecked): the range, through the key, must lie in
/// the mapping the unpacking made ([`maps::check_mapped`]). A key no transport reaches by
/// pointer (`UCS_ERR_UNREACHABLE`: cma, TCP, verbs, where the kernel, the peer or the NIC
/// checks the address) passes. `before` is the shared mappings before the unpacking.
fn verify_reach(
    api: &Api,
    handle: sys::ucp_rkey_h,
    base: u64,
    len: u64,
    before: std::io::Result<Vec<maps::Mapping>>,
) -> Result<(), String> {
    if len == 0 {
        return Ok(());
    }
    let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: `handle` is a live key; `ucp_rkey_ptr` only computes an address (no access).
    let status = unsafe { (api.ucp_rkey_ptr)(handle, base, &mut ptr) };
    if status == sys::UCS_ERR_UNREACHABLE {
        return Ok(());
    }
    if status != sys::UCS_OK {
        return Err(format!("ucp_rkey_ptr: {}", api.status_string(status)));
    }
    let (Ok(old), Ok(new)) = (before, maps::shared()) else {
        return Err(
            "the key is reached through shared memory, and this process's \
                    mappings (/proc/self/maps) cannot be read to check it"
                .into(),
        );
    };
    let host = maps::check_mapped(&old, &new, base, ptr as u64, len);
    if host.is_err() {
        // Device memory (`cuda_ipc` maps the peer's allocation into our context and copies
        // with the driver): the range must lie inside the one device allocation the key
        // points into, so a lie cannot reach past it (an illegal address would poison the
        // whole context). Which allocation that is, the driver does not say: a lie that
        // lands wholly inside another allocation of ours is not caught here
        // (ARCHITECTURE.md, open problems).
        if let Ok(Some((start, size))) = handoff_gpu::device_allocation(ptr as u64) {
            return maps::check_device(start, size, base, ptr as u64, len);
        }
    }
    host
}
