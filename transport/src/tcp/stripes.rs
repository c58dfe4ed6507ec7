//! A large call's operations over several connections at once, each driven by a thread of
//! its own.
//!
//! One loopback or LAN stream is bound by its two ends taking turns (the sender's copy
//! into the socket, the receiver's copy out of it), not by the link: two streams, each
//! with a thread at both ends, move about twice one's bytes. A task cannot be that
//! thread: the call borrows its region, so whatever moves the call's bytes must end
//! before the call does, and a spawned task can outlive a call's dropped future. So a
//! striped call runs inside `block_in_place` on scoped threads (the calling thread is the
//! first stripe), with blocking I/O under the call's deadline: the call cannot be dropped
//! halfway, and nothing of it moves after it returns.
//!
//! The stripes take the plan's operations in turn (an atomic counter), each keeping at
//! most [`OPS_INFLIGHT_MAX`] unanswered on its connection, so a stripe the host stops for
//! a while leaves its share to the others. A stripe that fails stops the others at their
//! next operation or their next wait; the first failure is the call's answer. A
//! connection is handed back for reuse only when its stripe ended with every operation
//! answered.

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::client::Answer;
use super::client::{check_answer, check_read_end, local_slices, local_slices_mut, op_header};
use super::frame::{Header, HEADER_BYTES};
use super::io::{encode_head, io_error, open_head, plain_header, sealed_head_len, set_low_water};
use super::io::{IOV_PER_WRITE_MAX, RECV_LOW_WATER_MAX};
use super::OPS_INFLIGHT_MAX;
use crate::auth::TAG_BYTES;
use crate::data::plan::Plan;
use crate::data::{Access, DataError};
use crate::noise::{Opener, Sealer};
use crate::region::Region;
use crate::types::RequestId;

/// Longest sleep of a stripe waiting for its socket before it looks whether another stripe
/// failed: bounds how long a failed call's other stripes run on.
const STOP_CHECK_EVERY: Duration = Duration::from_millis(10);

/// A handshaken connection, taken out of the runtime's reactor for a striped call: its
/// socket stays non-blocking, and its stripe waits with `poll`.
pub(super) struct StdConn {
    pub(super) stream: TcpStream,
    pub(super) sealer: Option<Sealer>,
    pub(super) opener: Option<Opener>,
    pub(super) seq: u32,
    pub(super) meta: Vec<u8>,
}

/// One striped call: what every stripe shares.
pub(super) struct Job<'a> {
    pub(super) peer: &'a str,
    pub(super) request: &'a RequestId,
    pub(super) region: &'a Region,
    pub(super) plan: &'a Plan,
    pub(super) access: Access,
    pub(super) deadline: Instant,
    /// When the call began (for a timeout's report).
    pub(super) started: Instant,
    /// The next operation not taken by a stripe.
    next: AtomicUsize,
    /// Set by the first stripe that fails.
    stop: AtomicBool,
    /// That first failure.
    failed: Mutex<Option<DataError>>,
}

impl<'a> Job<'a> {
    pub(super) fn new(
        peer: &'a str,
        request: &'a RequestId,
        region: &'a Region,
        plan: &'a Plan,
        access: Access,
        started: Instant,
        deadline: Instant,
    ) -> Self {
        Job {
            peer,
            request,
            region,
            plan,
            access,
            deadline,
            started,
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
        }
    }

    fn fail(&self, error: DataError) {
        self.stop.store(true, Ordering::Relaxed);
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        failed.get_or_insert(error);
    }
}

/// How a stripe's wait or transfer ended short.
enum Halt {
    /// The socket's error.
    Io(&'static str, io::Error),
    /// The call's deadline passed.
    TimedOut,
    /// Another stripe failed.
    Stopped,
    /// The protocol's or the region's error.
    Failed(DataError),
}

impl From<DataError> for Halt {
    fn from(e: DataError) -> Self {
        Halt::Failed(e)
    }
}

/// Runs `job` over `conns`, a stripe each (the first on this thread), until every operation
/// is answered, a stripe fails, or the deadline passes; returns only once every stripe has
/// ended. Each connection's flag says whether it may be reused: its stripe ended with
/// nothing unanswered.
pub(super) fn run(conns: &mut [StdConn], job: &Job<'_>) -> (Result<(), DataError>, Vec<bool>) {
    let ended: Vec<bool> = std::thread::scope(|scope| {
        let Some((first, rest)) = conns.split_first_mut() else {
            return Vec::new();
        };
        let helpers: Vec<_> = rest
            .iter_mut()
            .map(|conn| {
                std::thread::Builder::new()
                    .name("handoff-tcp".into())
                    .spawn_scoped(scope, move || stripe(conn, job))
            })
            .collect();
        let mut ended = vec![stripe(first, job)];
        for helper in helpers {
            ended.push(match helper {
                Ok(thread) => thread.join().unwrap_or_else(|_| {
                    job.fail(DataError::Io {
                        peer: job.peer.to_string(),
                        detail: "a transfer thread panicked".into(),
                    });
                    false
                }),
                // No thread: its connection moved nothing, and the others took its share.
                Err(_) => true,
            });
        }
        ended
    });
    let failed = job.failed.lock().unwrap_or_else(|p| p.into_inner()).take();
    match failed {
        Some(error) => (Err(error), ended),
        None => (Ok(()), ended),
    }
}

/// One stripe: whether its connection ended clean (a failure is recorded in the job).
fn stripe(conn: &mut StdConn, job: &Job<'_>) -> bool {
    match operations(conn, job) {
        Ok(()) => true,
        Err(Halt::Stopped) => false,
        Err(Halt::TimedOut) => {
            job.fail(DataError::Timeout {
                peer: job.peer.to_string(),
                op: match job.access {
                    Access::Write => "write",
                    Access::Read => "read",
                },
                after: job.started.elapsed(),
            });
            false
        }
        Err(Halt::Io(op, e)) => {
            job.fail(io_error(job.peer, op, e));
            false
        }
        Err(Halt::Failed(e)) => {
            job.fail(e);
            false
        }
    }
}

/// Takes operations in turn and sends each, keeping at most [`OPS_INFLIGHT_MAX`]
/// unanswered, and takes every answer.
fn operations(conn: &mut StdConn, job: &Job<'_>) -> Result<(), Halt> {
    let StdConn {
        stream,
        sealer,
        opener,
        seq,
        meta,
    } = conn;
    let wire = Wire {
        stream,
        job,
        low_water: std::cell::Cell::new(1),
    };
    let (plan, peer) = (job.plan, job.peer);
    let mut inflight: VecDeque<(usize, u32)> = VecDeque::with_capacity(OPS_INFLIGHT_MAX);
    let (mut head, mut answer) = (Vec::new(), Vec::new());
    let mut taking = true;
    loop {
        while taking && inflight.len() < OPS_INFLIGHT_MAX {
            if job.stop.load(Ordering::Relaxed) {
                return Err(Halt::Stopped);
            }
            let k = job.next.fetch_add(1, Ordering::Relaxed);
            if k >= plan.ops.len() {
                taking = false;
                break;
            }
            let this = *seq;
            *seq = seq.wrapping_add(1);
            let header = op_header(job.request, plan, k, job.access, this, meta);
            encode_head(header, meta, sealer.as_mut(), &mut head)
                .map_err(|e| Halt::Io("sending", e))?;
            let mut bufs = vec![IoSlice::new(&head)];
            if job.access == Access::Write {
                bufs.extend(local_slices(job.region, &plan.pieces[plan.ops[k].clone()])?);
            }
            wire.write_all(&mut bufs, "sending")?;
            inflight.push_back((k, this));
        }
        let Some((k, this)) = inflight.pop_front() else {
            return Ok(());
        };
        let bytes = plan.op_bytes(k);
        let got = wire.read_head(opener.as_mut(), &mut answer, "awaiting an answer")?;
        if check_answer(&got, &answer, job.access, this, bytes, peer)? == Answer::DataFollows {
            let mut bufs = local_slices_mut(job.region, &plan.pieces[plan.ops[k].clone()])?;
            wire.read_exact(&mut bufs, "receiving read data")?;
            let end = wire.read_head(
                opener.as_mut(),
                &mut answer,
                "awaiting a read's confirmation",
            )?;
            check_read_end(&end, &answer, this, peer)?;
        }
    }
}

/// A stripe's socket, waited on under its call's deadline and stop flag.
struct Wire<'a, 'j> {
    stream: &'a TcpStream,
    job: &'a Job<'j>,
    /// The socket's receive low-water mark now (1: the kernel's default).
    low_water: std::cell::Cell<usize>,
}

impl Wire<'_, '_> {
    /// Sets the socket's receive low-water mark to `bytes` (at least 1): a wait for bytes
    /// returns once that many have arrived. The connection goes back to the runtime with
    /// the default (`Conn::from_std`).
    fn low_water(&self, bytes: usize) -> Result<(), Halt> {
        let bytes = bytes.max(1);
        if self.low_water.get() != bytes {
            set_low_water(self.stream, bytes).map_err(|e| Halt::Io("setting SO_RCVLOWAT", e))?;
            self.low_water.set(bytes);
        }
        Ok(())
    }

    /// Waits until the socket is ready for `events` (or has an error or hung up: the next
    /// call says which), the deadline passes, or another stripe fails.
    fn wait(&self, events: libc::c_short) -> Result<(), Halt> {
        loop {
            if self.job.stop.load(Ordering::Relaxed) {
                return Err(Halt::Stopped);
            }
            let left = self.job.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Halt::TimedOut);
            }
            let ms = left.min(STOP_CHECK_EVERY).as_millis().max(1) as libc::c_int;
            let mut fd = libc::pollfd {
                fd: self.stream.as_raw_fd(),
                events,
                revents: 0,
            };
            // SAFETY: one `pollfd` of a socket this stripe owns, for the length given.
            let ready = unsafe { libc::poll(&mut fd, 1, ms) };
            if ready > 0 {
                return Ok(());
            }
            if ready < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(Halt::Io("waiting", e));
                }
            }
        }
    }

    /// Writes every byte of `bufs`, at most [`IOV_PER_WRITE_MAX`] buffers per call.
    fn write_all(&self, mut bufs: &mut [IoSlice<'_>], op: &'static str) -> Result<(), Halt> {
        loop {
            // Past empty buffers: a call with nothing to write would answer 0.
            IoSlice::advance_slices(&mut bufs, 0);
            if bufs.is_empty() {
                return Ok(());
            }
            let n = bufs.len().min(IOV_PER_WRITE_MAX);
            match (&mut &*self.stream).write_vectored(&bufs[..n]) {
                Ok(0) => return Err(Halt::Io(op, io::ErrorKind::WriteZero.into())),
                Ok(written) => IoSlice::advance_slices(&mut bufs, written),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait(libc::POLLOUT)?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Halt::Io(op, e)),
            }
        }
    }

    /// Fills every buffer of `bufs` from the socket, in order.
    fn read_exact(&self, mut bufs: &mut [IoSliceMut<'_>], op: &'static str) -> Result<(), Halt> {
        loop {
            // Past empty buffers: a call with nothing to fill would answer 0, as at the end.
            IoSliceMut::advance_slices(&mut bufs, 0);
            if bufs.is_empty() {
                return Ok(());
            }
            let n = bufs.len().min(IOV_PER_WRITE_MAX);
            match (&mut &*self.stream).read_vectored(&mut bufs[..n]) {
                Ok(0) => return Err(Halt::Io(op, io::ErrorKind::UnexpectedEof.into())),
                Ok(read) => IoSliceMut::advance_slices(&mut bufs, read),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left: usize = bufs.iter().map(|b| b.len()).sum();
                    self.low_water(left.min(RECV_LOW_WATER_MAX))?;
                    self.wait(libc::POLLIN)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Halt::Io(op, e)),
            }
        }
    }

    fn read_bytes(&self, buf: &mut [u8], op: &'static str) -> Result<(), Halt> {
        self.read_exact(&mut [IoSliceMut::new(buf)], op)
    }

    /// Reads one frame's header and metadata (into `meta`), as the runtime's `read_head`.
    fn read_head(
        &self,
        opener: Option<&mut Opener>,
        meta: &mut Vec<u8>,
        op: &'static str,
    ) -> Result<Header, Halt> {
        let peer = self.job.peer;
        if let Some(opener) = opener {
            let mut len = [0u8; 2];
            self.read_bytes(&mut len, op)?;
            let mut sealed = vec![0u8; sealed_head_len(u16::from_le_bytes(len), peer)?];
            self.read_bytes(&mut sealed, op)?;
            return Ok(open_head(opener, &sealed, meta, peer)?);
        }
        let mut bytes = [0u8; HEADER_BYTES];
        self.read_bytes(&mut bytes, op)?;
        let header = plain_header(&bytes, meta, peer)?;
        self.read_bytes(meta, op)?;
        if header.has_tag() {
            let mut tag = [0u8; TAG_BYTES];
            self.read_bytes(&mut tag, op)?;
        }
        Ok(header)
    }
}
