//! Same-host copies: moving blocks straight between two processes' memory with the kernel's
//! cross-memory attach (`process_vm_readv` / `process_vm_writev`), one system call for up
//! to [`IOVECS_PER_CALL_MAX`] segments, no thread of the peer involved.
//!
//! Why: an engine's KV cache is heap memory it allocated (torch tensors), and UCX, under
//! the peer-failure handling every endpoint of ours uses, moves RMA into heap memory on one
//! host by software emulation: active messages over shared memory that the *peer's* UCX
//! thread must serve. On a busy host (an engine loop spinning on every core) that costs
//! hundreds of microseconds to milliseconds per transfer. The kernel's copy needs nothing
//! of the peer: a 512 KiB block moves in tens of microseconds.
//!
//! Who may be copied to: only the process at the other end of our authenticated control
//! connection, checked by the kernel's own tables, never by what the peer claims alone.
//! [`PeerProcess::verify`] takes the pid the peer stated and our control connection's two
//! addresses, finds the peer's end of that TCP connection in `/proc/net/tcp{,6}` (its
//! socket inode) and requires the stated process to hold that socket among its open files.
//! So a peer cannot point our copies at a third process. Reading `/proc/PID/fd` needs the
//! same permission as the copies themselves (same user, or `CAP_SYS_PTRACE`): where it is
//! refused, copies are refused too and the caller keeps its other lanes.
//!
//! What a peer's lie can do: the addresses copied to and from come from the peer's layout
//! (checked for shape by the caller). A wrong address is the peer's own memory or unmapped
//! there; the kernel then answers `EFAULT`, which is a named [`SameHostError`], never a
//! fault in this process: nothing of the peer is ever mapped here.
//!
//! A peer that exits: its pid is held by a pidfd opened before the check, polled before
//! every call, so a copy never starts towards a process that exited (whose pid could be
//! reused); a peer that exits during a call fails it (`ESRCH`/`EFAULT`).
//!
//! Fences: a writer's [`Lease`] is checked before every call, as UCX posts are; one call
//! moves at most [`BYTES_PER_CALL_MAX`], which bounds what a writer stopped inside a call
//! can still land after it resumes (the same small window as a posted UCX operation).
//!
//! Lanes: the kernel copies in the thread that makes the call, so one thread caps a copy at
//! one core's memcpy. [`copy_in_lanes`] splits a large copy over a few threads, each
//! making [`copy`]'s checks before each of its calls; it returns only once every lane has
//! ended, so nothing of a copy runs after its answer, and a writer stopped past its lease
//! lands at most one call per lane.

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::lease::Lease;

/// Segments one system call lists (Linux's `IOV_MAX`).
pub const IOVECS_PER_CALL_MAX: usize = 1024;

/// Bytes one system call moves at most: a copy is checked (deadline, lease, the peer alive)
/// between calls, so this bounds the work done past a check (about 0.1–0.3 ms of copying).
pub const BYTES_PER_CALL_MAX: usize = 1 << 20;

/// Threads one copy runs on at most ([`copy_in_lanes`]). The kernel copies in the calling
/// thread, so a copy split over threads moves in parallel: on this project's 2-core test
/// machine two threads moved 1.6–2.1× one thread's bytes, from 16 KiB pieces to 4 MiB. Past
/// a few threads memory bandwidth, not the CPU, bounds a copy, and every lane is a core the
/// engine does not have for the call.
pub const LANES_MAX: usize = 4;

/// Bytes each lane of a split copy gets at least: starting a thread costs tens of
/// microseconds, a few percent of copying this much.
pub const LANE_BYTES_MIN: u64 = 1 << 20;

/// Open files of the peer scanned for its end of the control connection, at most.
pub const PEER_FDS_SCANNED_MAX: usize = 1 << 20;

/// Lines of `/proc/net/tcp{,6}` read, at most.
const TCP_TABLE_LINES_MAX: usize = 1 << 22;

/// Why a same-host copy was refused or failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SameHostError {
    /// The peer cannot be shown to be the process at the other end of our connection.
    #[error("peer process {pid}: not verified: {detail}")]
    NotVerified {
        /// The pid the peer stated.
        pid: u32,
        /// What failed.
        detail: String,
    },
    /// The peer process exited (its pid may be reused).
    #[error("peer process {pid} has exited")]
    PeerExited {
        /// Its pid.
        pid: u32,
    },
    /// A writer's lease with the peer has ended: nothing more is written.
    #[error("write lease with peer process {pid} {}, after {moved} bytes: the peer may have given our grant's blocks back", match .ago { Some(ago) => format!("ended {ago:?} ago"), None => "was revoked (the peer was lost)".to_string() })]
    LeaseExpired {
        /// The peer's pid.
        pid: u32,
        /// Bytes moved before the check failed.
        moved: u64,
        /// How long ago the lease ended; `None` when it was revoked.
        ago: Option<Duration>,
    },
    /// The deadline passed between calls.
    #[error("copy with peer process {pid} past its deadline after {moved} of {total} bytes")]
    Timeout {
        /// The peer's pid.
        pid: u32,
        /// Bytes moved.
        moved: u64,
        /// Bytes asked for.
        total: u64,
    },
    /// The kernel refused a call.
    #[error("{op} with peer process {pid} failed at {remote:#x} (+{len} bytes), after {moved} bytes: {error}")]
    Copy {
        /// `process_vm_readv` or `process_vm_writev`.
        op: &'static str,
        /// The peer's pid.
        pid: u32,
        /// The peer address of the first segment of the failed call.
        remote: u64,
        /// Its length.
        len: usize,
        /// Bytes moved before.
        moved: u64,
        /// The system's error (`EFAULT`: an address not mapped, ours or the peer's).
        error: String,
    },
}

/// The peer process of one control connection, verified to hold that connection's socket;
/// held by a pidfd, so that its exit is seen before a copy starts.
pub struct PeerProcess {
    pid: u32,
    pidfd: OwnedFd,
}

impl fmt::Debug for PeerProcess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerProcess")
            .field("pid", &self.pid)
            .finish()
    }
}

impl PartialEq for PeerProcess {
    fn eq(&self, other: &Self) -> bool {
        self.pid == other.pid
    }
}

impl Eq for PeerProcess {}

impl PeerProcess {
    /// The process `pid` as the peer at the other end of our TCP connection from `ours` to
    /// `theirs` (our socket's local and peer addresses), if the kernel agrees: the socket
    /// with local address `theirs` and peer address `ours` is found in this network
    /// namespace's TCP tables and `pid` holds it. Refused by name otherwise (another
    /// network or pid namespace, another user, a proxy in between, a peer that lied).
    pub fn verify(pid: u32, ours: SocketAddr, theirs: SocketAddr) -> Result<Self, SameHostError> {
        let refuse = |detail: String| SameHostError::NotVerified { pid, detail };
        if pid == 0 || i32::try_from(pid).is_err() {
            return Err(refuse("no pid stated".into()));
        }
        // The pidfd first: if the process exits and its pid is reused after this, the
        // scan below looks at the new process, which does not hold our connection.
        let process = Self::open(pid)?;
        let inode = socket_inode(theirs, ours).map_err(&refuse)?;
        let wanted = format!("socket:[{inode}]");
        let dir = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map_err(|e| refuse(format!("its open files: {e}")))?;
        let mut found = false;
        for entry in dir.take(PEER_FDS_SCANNED_MAX) {
            let Ok(entry) = entry else { continue };
            if std::fs::read_link(entry.path()).is_ok_and(|l| l.as_os_str() == wanted.as_str()) {
                found = true;
                break;
            }
        }
        if !found {
            return Err(refuse(format!(
                "it does not hold the socket of our connection ({theirs} -> {ours}, inode {inode})"
            )));
        }
        if !process.alive() {
            return Err(SameHostError::PeerExited { pid });
        }
        process.check_access()?;
        Ok(process)
    }

    /// A process the caller vouches for (a child it started, or itself), without the
    /// connection check: for benchmarks and tests.
    pub fn vouched(pid: u32) -> Result<Self, SameHostError> {
        let process = Self::open(pid)?;
        process.check_access()?;
        Ok(process)
    }

    fn open(pid: u32) -> Result<Self, SameHostError> {
        let refuse = |detail: String| SameHostError::NotVerified { pid, detail };
        let raw = i32::try_from(pid).map_err(|_| refuse("pid out of range".into()))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) => SameHostError::PeerExited { pid },
                _ => refuse(format!("pidfd_open: {e}")),
            });
        }
        let fd = i32::try_from(fd).map_err(|_| refuse("pidfd out of range".into()))?;
        // SAFETY: `fd` is a descriptor we just opened and own.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { pid, pidfd })
    }

    /// The kernel's permission for cross-memory attach to the process, tried as UCX does:
    /// a read from address 0 fails `EFAULT` when permitted, `EPERM` when not.
    fn check_access(&self) -> Result<(), SameHostError> {
        let mut probe = [0u8; 1];
        let local = libc::iovec {
            iov_base: probe.as_mut_ptr().cast(),
            iov_len: probe.len(),
        };
        let remote = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 1,
        };
        // SAFETY: one local iovec over `probe`; the remote one is only read by the kernel.
        let n = unsafe { libc::process_vm_readv(self.pid as i32, &local, 1, &remote, 1, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EFAULT) => Ok(()),
                Some(libc::ESRCH) => Err(SameHostError::PeerExited { pid: self.pid }),
                _ => Err(SameHostError::NotVerified {
                    pid: self.pid,
                    detail: format!("cross-memory attach refused: {e}"),
                }),
            };
        }
        Ok(())
    }

    /// The peer's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// False once the process has exited (its pidfd is readable).
    pub fn alive(&self) -> bool {
        let mut poll = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, zero timeout.
        let n = unsafe { libc::poll(&mut poll, 1, 0) };
        n == 0
    }
}

/// One contiguous piece of a copy: `len` bytes at `local` (ours) and at `remote` (the
/// peer's address space).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Our address.
    pub local: u64,
    /// The peer's address.
    pub remote: u64,
    /// Bytes, not zero.
    pub len: usize,
}

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// The peer's memory into ours.
    Read,
    /// Ours into the peer's.
    Write,
}

impl Way {
    /// The system call that copies this way.
    fn call(self) -> &'static str {
        match self {
            Way::Read => "process_vm_readv",
            Way::Write => "process_vm_writev",
        }
    }
}

/// Copies every piece between our memory and `peer`'s, in calls of at most
/// [`IOVECS_PER_CALL_MAX`] segments and [`BYTES_PER_CALL_MAX`] bytes; before each call the
/// deadline, the peer's liveness and (for a write) the `lease` are checked. Returns the
/// bytes moved (all of them on `Ok`).
///
/// # Safety
/// Every `local` range must be memory of this process that is ours to read (a write) or to
/// overwrite (a read) for the whole call: the kernel writes into it as a `memcpy` would.
/// Peer addresses need no such promise: a bad one is `EFAULT`.
pub unsafe fn copy(
    peer: &PeerProcess,
    way: Way,
    pieces: &[Piece],
    deadline: Instant,
    lease: Option<&Lease>,
) -> Result<u64, SameHostError> {
    // SAFETY: the caller's promise.
    unsafe { copy_until(peer, way, pieces, deadline, lease, None) }
}

/// Whether this thread may hand its runtime worker's other tasks away and block
/// (`tokio::task::block_in_place`): inside a multi-threaded runtime only.
pub fn may_block_in_place() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// Environment variable capping the lanes of one copy ([`lanes_for`]), and the stripes of
/// one TCP call (each a connection and a thread): `1` moves each on the calling thread only
/// (an engine that keeps its cores to itself, or a comparison).
pub const LANES_ENV: &str = "HANDOFF_COPY_LANES";

/// How many lanes [`copy_in_lanes`] gives a copy of `bytes` here: one per
/// [`LANE_BYTES_MIN`], at most [`LANES_MAX`], the cores this process may run on and
/// [`LANES_ENV`] (read once; unset or unparsable: no cap).
pub fn lanes_for(bytes: u64) -> usize {
    static CAP: OnceLock<usize> = OnceLock::new();
    let cap = *CAP.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let asked = std::env::var(LANES_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok());
        asked.map_or(cores, |n| n.min(cores))
    });
    let by_bytes = usize::try_from(bytes / LANE_BYTES_MIN).unwrap_or(usize::MAX);
    by_bytes.min(cap).clamp(1, LANES_MAX)
}

/// The pieces cut into runs of at most `share` bytes (at least 1), in order (a piece on a
/// boundary is split there); none is empty.
fn split_runs(pieces: &[Piece], share: u64) -> Vec<Vec<Piece>> {
    let share = share.max(1);
    let mut out: Vec<Vec<Piece>> = Vec::new();
    let mut room = 0u64;
    for p in pieces {
        let mut p = *p;
        while p.len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = share;
            }
            let take = (p.len as u64).min(room) as usize;
            if let Some(run) = out.last_mut() {
                run.push(Piece { len: take, ..p });
            }
            room -= take as u64;
            p.local += take as u64;
            p.remote += take as u64;
            p.len -= take;
        }
    }
    out
}

/// Bytes a lane of [`copy_in_lanes`] takes at a time: small enough that a lane whose thread
/// the host stops for a while leaves the rest of the copy to the others, large enough that
/// taking one costs nothing next to copying it.
pub const LANE_RUN_BYTES: u64 = 256 << 10;

/// [`copy`] split over `lanes` threads: this one and, for the call, `lanes - 1` more. The
/// pieces are cut into runs of [`LANE_RUN_BYTES`], and each lane takes the
/// next run until none is left, so a lane stopped by the host for a while leaves its share
/// to the others; every run is moved by [`copy`], with its checks before each call. The
/// call returns once every lane has ended, so nothing of it runs after; a lane that fails
/// stops the others at their next check, and the failure of the earliest run is the
/// answer. A thread that cannot be started leaves its share to the others. What a writer
/// stopped past its lease can still land is one call per lane.
///
/// # Safety
/// As [`copy`].
pub unsafe fn copy_in_lanes(
    peer: &PeerProcess,
    way: Way,
    pieces: &[Piece],
    deadline: Instant,
    lease: Option<&Lease>,
    lanes: usize,
) -> Result<u64, SameHostError> {
    if lanes <= 1 {
        // SAFETY: the caller's promise.
        return unsafe { copy(peer, way, pieces, deadline, lease) };
    }
    let runs = split_runs(pieces, LANE_RUN_BYTES);
    let lanes = lanes.min(LANES_MAX).min(runs.len());
    let (next, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    // A lane: runs taken in turn until none is left or another lane failed; what it moved,
    // and its failure with the run's index.
    let lane = || -> LaneEnd {
        let mut moved = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(run) = runs.get(i) else { break };
            // SAFETY: the caller's promise covers every piece; the scope below ends every
            // lane before this call returns.
            match unsafe { copy_until(peer, way, run, deadline, lease, Some(&stop)) } {
                Ok(n) => moved += n,
                Err(error) => {
                    stop.store(true, Ordering::Relaxed);
                    return (moved, Some((i, error)));
                }
            }
        }
        (moved, None)
    };
    in_lanes(lanes, way.call(), peer.pid, &stop, lane)
}

/// What a lane of a split copy ends with: the bytes it moved, and its failure with the
/// index of the run or call that failed.
type LaneEnd = (u64, Option<(usize, SameHostError)>);

/// Runs `lane` on `lanes` threads: this one and, for the call, `lanes - 1` more (one that
/// cannot be started leaves its share to the others, since lanes take work in turn). Every
/// lane has ended when this returns. The answer is the bytes moved, or the failure of the
/// earliest run; a lane that panicked sets `stop` and fails the copy.
fn in_lanes(
    lanes: usize,
    op: &'static str,
    pid: u32,
    stop: &AtomicBool,
    lane: impl Fn() -> LaneEnd + Sync,
) -> Result<u64, SameHostError> {
    let lane = &lane;
    let ended = std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..lanes)
            .filter_map(|_| {
                std::thread::Builder::new()
                    .name("handoff-copy".into())
                    .spawn_scoped(scope, lane)
                    .ok()
            })
            .collect();
        let mut ended = vec![lane()];
        for helper in helpers {
            ended.push(helper.join().unwrap_or_else(|_| {
                stop.store(true, Ordering::Relaxed);
                let error = SameHostError::Copy {
                    op,
                    pid,
                    remote: 0,
                    len: 0,
                    moved: 0,
                    error: "a copy thread panicked".into(),
                };
                (0, Some((usize::MAX, error)))
            }));
        }
        ended
    });
    let moved = ended.iter().map(|(n, _)| n).sum();
    match ended
        .into_iter()
        .filter_map(|(_, e)| e)
        .min_by_key(|(i, _)| *i)
    {
        Some((_, error)) => Err(error),
        None => Ok(moved),
    }
}

/// [`copy`], which also ends (with what it moved) once `stop` is set: another lane of the
/// same copy failed.
unsafe fn copy_until(
    peer: &PeerProcess,
    way: Way,
    pieces: &[Piece],
    deadline: Instant,
    lease: Option<&Lease>,
    stop: Option<&AtomicBool>,
) -> Result<u64, SameHostError> {
    let total: u64 = pieces.iter().map(|p| p.len as u64).sum();
    let pid = peer.pid;
    type VmCall = unsafe extern "C" fn(
        libc::pid_t,
        *const libc::iovec,
        libc::c_ulong,
        *const libc::iovec,
        libc::c_ulong,
        libc::c_ulong,
    ) -> libc::ssize_t;
    let call: VmCall = match way {
        Way::Read => libc::process_vm_readv,
        Way::Write => libc::process_vm_writev,
    };
    let op = way.call();
    let mut moved = 0u64;
    // Where the next call starts: piece index and bytes of it already moved.
    let (mut at, mut skip) = (0usize, 0usize);
    let mut local: Vec<libc::iovec> = Vec::with_capacity(IOVECS_PER_CALL_MAX.min(pieces.len()));
    let mut remote: Vec<libc::iovec> = Vec::with_capacity(local.capacity());
    let lease = lease.filter(|_| way == Way::Write);
    while at < pieces.len() {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return Ok(moved);
        }
        before_call(peer, deadline, lease, moved, total)?;
        local.clear();
        remote.clear();
        let mut bytes = 0usize;
        let (mut i, mut off) = (at, skip);
        while i < pieces.len() && bytes < BYTES_PER_CALL_MAX {
            let p = pieces[i];
            let len = (p.len - off).min(BYTES_PER_CALL_MAX - bytes);
            // The kernel streams the remote list into the local one, so each side merges
            // with its own last segment, whatever the other side does: an engine's pages
            // scattered on one side and in order on the other still make long segments
            // there (the kernel pins the peer's pages once per segment).
            let (l, r) = (p.local + off as u64, p.remote + off as u64);
            let l_joins = joins(&local, l);
            let r_joins = joins(&remote, r);
            if (!l_joins && local.len() == IOVECS_PER_CALL_MAX)
                || (!r_joins && remote.len() == IOVECS_PER_CALL_MAX)
            {
                break;
            }
            extend(&mut local, l_joins, l, len);
            extend(&mut remote, r_joins, r, len);
            bytes += len;
            if off + len == p.len {
                i += 1;
                off = 0;
            } else {
                off += len;
            }
        }
        let first = (pieces[at].remote + skip as u64, remote[0].iov_len);
        // SAFETY: the caller promised the local ranges; the lists are as long as said.
        let n = unsafe {
            call(
                pid as i32,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        let failed = |error: String| SameHostError::Copy {
            op,
            pid,
            remote: first.0,
            len: first.1,
            moved,
            error,
        };
        if n < 0 {
            match failed_call(pid, failed) {
                None => continue,
                Some(e) => return Err(e),
            }
        }
        let mut done = n as usize;
        if done == 0 {
            return Err(failed("no byte moved".into()));
        }
        moved += done as u64;
        // Advance past what moved (a short count: a later segment faulted; the next call
        // starts there and names it).
        while done > 0 && at < pieces.len() {
            let left = pieces[at].len - skip;
            if done >= left {
                done -= left;
                at += 1;
                skip = 0;
            } else {
                skip += done;
                done = 0;
            }
        }
    }
    Ok(moved)
}

/// Peer bytes between two pieces that a gathered read ([`read_gathered`]) reads too, at
/// most: one page, which the kernel pins for the pieces around it anyway.
pub const GATHER_GAP_MAX: u64 = 4096;

/// Reads `pieces` from the peer's memory into ours through a scratch buffer: pieces whose
/// peer addresses lie at most [`GATHER_GAP_MAX`] apart inside one of `within` (the peer's
/// registered ranges, as `(start, end)`) are read as one segment, then copied to where
/// each belongs here. For many small pieces scattered over the peer's memory (an engine's
/// pages of one token, allocated in any order) this is several times faster than one
/// segment per piece: the kernel pins the peer's pages per segment. Each call reads at
/// most [`BYTES_PER_CALL_MAX`] into the scratch buffer; the deadline and the peer's
/// liveness are checked before each. Returns the bytes of the pieces.
///
/// # Safety
/// As [`copy`] for a read: every `local` range must be ours to overwrite for the call.
pub unsafe fn read_gathered(
    peer: &PeerProcess,
    pieces: &[Piece],
    within: &[(u64, u64)],
    deadline: Instant,
) -> Result<u64, SameHostError> {
    // SAFETY: the caller's promise; one lane.
    unsafe { read_gathered_in_lanes(peer, pieces, within, deadline, 1) }
}

/// [`read_gathered`] over `lanes` threads (this one and, for the call, `lanes - 1` more),
/// each with a scratch buffer of its own, taking the calls in turn as
/// [`copy_in_lanes`]'s lanes take runs: the reads and the copying out of scratch run in
/// parallel. The call returns once every lane has ended; a lane that fails stops the
/// others at their next check, and the failure of the earliest call is the answer.
///
/// # Safety
/// As [`read_gathered`], and no two `local` ranges overlap (lanes write them at once).
pub unsafe fn read_gathered_in_lanes(
    peer: &PeerProcess,
    pieces: &[Piece],
    within: &[(u64, u64)],
    deadline: Instant,
    lanes: usize,
) -> Result<u64, SameHostError> {
    // A piece longer than one call is read in parts of one call each: every span must fit
    // the scratch buffer, which holds one call.
    let parts: Vec<Piece>;
    let pieces = if pieces.iter().any(|p| p.len > BYTES_PER_CALL_MAX) {
        parts = pieces
            .iter()
            .flat_map(|p| {
                (0..p.len)
                    .step_by(BYTES_PER_CALL_MAX)
                    .map(move |off| Piece {
                        local: p.local + off as u64,
                        remote: p.remote + off as u64,
                        len: (p.len - off).min(BYTES_PER_CALL_MAX),
                    })
            })
            .collect();
        &parts[..]
    } else {
        pieces
    };
    let total: u64 = pieces.iter().map(|p| p.len as u64).sum();
    let pid = peer.pid;
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_unstable_by_key(|&i| pieces[i].remote);
    let mut ranges = within.to_vec();
    ranges.sort_unstable();
    // The range holding a piece: the last that starts at or before it (a lying peer's
    // overlapping ranges can only make pieces read alone).
    let range_of = |addr: u64, len: usize| {
        let i = ranges.partition_point(|&(a, _)| a <= addr).checked_sub(1)?;
        (addr.saturating_add(len as u64) <= ranges[i].1).then_some(i)
    };
    // Spans of the peer's memory: (start, end, range, first..last index into `order`).
    let mut spans: Vec<(u64, u64, Option<usize>, usize, usize)> = Vec::new();
    for (k, &i) in order.iter().enumerate() {
        let p = pieces[i];
        let end = p.remote.saturating_add(p.len as u64);
        let range = range_of(p.remote, p.len);
        if let Some(last) = spans.last_mut() {
            let (start, last_end, last_range) = (last.0, last.1, last.2);
            if range.is_some()
                && range == last_range
                && p.remote <= last_end.saturating_add(GATHER_GAP_MAX)
                && end.max(last_end) - start <= BYTES_PER_CALL_MAX as u64
            {
                last.1 = last_end.max(end);
                last.4 = k + 1;
                continue;
            }
        }
        spans.push((p.remote, end, range, k, k + 1));
    }
    let most = spans
        .iter()
        .map(|s| s.1 - s.0)
        .max()
        .unwrap_or(0)
        .min(BYTES_PER_CALL_MAX as u64) as usize;
    let scratch_len = most.max(BYTES_PER_CALL_MAX.min(total as usize));
    // The calls: runs of spans that fit the scratch buffer and one call's segments.
    let mut calls: Vec<(usize, usize, usize)> = Vec::new();
    let mut at = 0usize;
    while at < spans.len() {
        let (mut bytes, mut next) = (0usize, at);
        while next < spans.len() && next - at < IOVECS_PER_CALL_MAX {
            let len = (spans[next].1 - spans[next].0) as usize;
            if bytes + len > scratch_len {
                break;
            }
            bytes += len;
            next += 1;
        }
        if next == at {
            // Cannot happen (every span fits): never call with nothing to read.
            return Err(SameHostError::Copy {
                op: "process_vm_readv",
                pid,
                remote: spans[at].0,
                len: (spans[at].1 - spans[at].0) as usize,
                moved: 0,
                error: "a span longer than the scratch buffer".into(),
            });
        }
        calls.push((at, next, bytes));
        at = next;
    }
    // One call: the spans read into `scratch`, then each piece copied to where it belongs.
    let read_call = |(at, next, bytes): (usize, usize, usize),
                     scratch: &mut [u8],
                     remote: &mut Vec<libc::iovec>,
                     moved: u64|
     -> Result<u64, SameHostError> {
        remote.clear();
        remote.extend(spans[at..next].iter().map(|s| libc::iovec {
            iov_base: s.0 as usize as *mut libc::c_void,
            iov_len: (s.1 - s.0) as usize,
        }));
        let local = libc::iovec {
            iov_base: scratch.as_mut_ptr().cast(),
            iov_len: bytes,
        };
        let n = loop {
            // SAFETY: one local segment, our scratch buffer, `bytes` long.
            let n = unsafe {
                libc::process_vm_readv(
                    pid as i32,
                    &local,
                    1,
                    remote.as_ptr(),
                    remote.len() as libc::c_ulong,
                    0,
                )
            };
            if n >= 0 {
                break n as usize;
            }
            let failed = |error| SameHostError::Copy {
                op: "process_vm_readv",
                pid,
                remote: spans[at].0,
                len: remote[0].iov_len,
                moved,
                error,
            };
            if let Some(e) = failed_call(pid, failed) {
                return Err(e);
            }
        };
        if n != bytes {
            // A span stopped short: name it (the peer's ranges are not all mapped).
            let (mut off, mut k) = (n, at);
            while k < next && off >= (spans[k].1 - spans[k].0) as usize {
                off -= (spans[k].1 - spans[k].0) as usize;
                k += 1;
            }
            return Err(SameHostError::Copy {
                op: "process_vm_readv",
                pid,
                remote: spans[k.min(next - 1)].0 + off as u64,
                len: bytes - n,
                moved,
                error: "short read: the peer's memory is not mapped there".into(),
            });
        }
        let (mut base, mut copied) = (0usize, 0u64);
        for span in &spans[at..next] {
            for &i in &order[span.3..span.4] {
                let p = pieces[i];
                let from = base + (p.remote - span.0) as usize;
                // SAFETY: `from..from + len` lies in this span's bytes of `scratch`; the
                // caller promised `p.local` is ours to overwrite for `len` bytes, and that
                // no other piece's is the same (another lane may be writing that one).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        scratch.as_ptr().add(from),
                        p.local as usize as *mut u8,
                        p.len,
                    );
                }
                copied += p.len as u64;
            }
            base += (span.1 - span.0) as usize;
        }
        Ok(copied)
    };
    let (next, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    // A lane: calls taken in turn until none is left or another lane failed.
    let lane = || -> LaneEnd {
        let (mut scratch, mut remote) = (Vec::new(), Vec::new());
        let mut moved = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(&call) = calls.get(i) else { break };
            if scratch.is_empty() {
                scratch = vec![0u8; scratch_len];
            }
            let done = before_call(peer, deadline, None, moved, total)
                .and_then(|()| read_call(call, &mut scratch, &mut remote, moved));
            match done {
                Ok(n) => moved += n,
                Err(error) => {
                    stop.store(true, Ordering::Relaxed);
                    return (moved, Some((i, error)));
                }
            }
        }
        (moved, None)
    };
    let lanes = lanes.clamp(1, LANES_MAX).min(calls.len().max(1));
    in_lanes(lanes, "process_vm_readv", pid, &stop, lane)
}

/// Checked before every call: the deadline, the writer's `lease` (`None` for a read) and
/// the peer's liveness.
fn before_call(
    peer: &PeerProcess,
    deadline: Instant,
    lease: Option<&Lease>,
    moved: u64,
    total: u64,
) -> Result<(), SameHostError> {
    let (now, pid) = (Instant::now(), peer.pid);
    if now >= deadline {
        return Err(SameHostError::Timeout { pid, moved, total });
    }
    if let Some(ago) = lease.and_then(|l| l.expired_for(now)) {
        return Err(SameHostError::LeaseExpired {
            pid,
            moved,
            ago: (ago != Duration::MAX).then_some(ago),
        });
    }
    if !peer.alive() {
        return Err(SameHostError::PeerExited { pid });
    }
    Ok(())
}

/// What a call that returned -1 means: `None` to call again (interrupted), else the error
/// (the peer gone, or `copy_failed` with the kernel's words).
fn failed_call(
    pid: u32,
    copy_failed: impl FnOnce(String) -> SameHostError,
) -> Option<SameHostError> {
    let error = io::Error::last_os_error();
    match error.raw_os_error() {
        Some(libc::EINTR) => None,
        Some(libc::ESRCH) => Some(SameHostError::PeerExited { pid }),
        _ => Some(copy_failed(error.to_string())),
    }
}

/// Whether a segment at `addr` continues the list's last one.
fn joins(list: &[libc::iovec], addr: u64) -> bool {
    list.last()
        .is_some_and(|v| v.iov_base as usize as u64 + v.iov_len as u64 == addr)
}

/// Adds `len` bytes at `addr` to the list: to its last segment when they continue it.
fn extend(list: &mut Vec<libc::iovec>, joins: bool, addr: u64, len: usize) {
    match list.last_mut() {
        Some(last) if joins => last.iov_len += len,
        _ => list.push(libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: len,
        }),
    }
}

/// The inode of the TCP socket in this network namespace whose local address is `local`
/// and whose peer is `peer`.
fn socket_inode(local: SocketAddr, peer: SocketAddr) -> Result<u64, String> {
    let (local, peer) = (canonical(local), canonical(peer));
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = match std::fs::read_to_string(table) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("{table}: {e}")),
        };
        for line in text.lines().skip(1).take(TCP_TABLE_LINES_MAX) {
            let fields: Vec<&str> = line.split_whitespace().take(10).collect();
            let [_, l, r, _, _, _, _, _, _, inode] = fields.as_slice() else {
                continue;
            };
            if parse_addr(l) == Some(local) && parse_addr(r) == Some(peer) {
                if let Ok(inode) = inode.parse::<u64>() {
                    if inode != 0 {
                        return Ok(inode);
                    }
                }
            }
        }
    }
    Err(format!(
        "no socket {local} -> {peer} in this network namespace"
    ))
}

fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6), as the kernel prints them:
/// each 32-bit word in this machine's byte order.
fn parse_addr(field: &str) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |s: &str| u32::from_str_radix(s, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::from(word(ip)?),
        32 => {
            let mut bytes = [0u8; 16];
            for (k, chunk) in bytes.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&word(ip.get(k * 8..k * 8 + 8)?)?);
            }
            IpAddr::from(bytes)
        }
        _ => return None,
    };
    Some(canonical(SocketAddr::new(ip, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_addresses_parse_in_this_machines_byte_order() {
        let v4 = parse_addr("0100007F:1F90").unwrap();
        assert_eq!(v4, "127.0.0.1:8080".parse().unwrap());
        // ::ffff:127.0.0.1 as tcp6 prints it, canonical to IPv4.
        let mapped = parse_addr("0000000000000000FFFF00000100007F:0050").unwrap();
        assert_eq!(mapped, "127.0.0.1:80".parse().unwrap());
        let v6 = parse_addr("00000000000000000000000001000000:0016").unwrap();
        assert_eq!(v6, "[::1]:22".parse().unwrap());
        assert_eq!(parse_addr("nonsense"), None);
        assert_eq!(parse_addr("0100007F:ZZZZ"), None);
        assert_eq!(parse_addr("0100:0050"), None);
    }

    #[test]
    fn pieces_in_order_on_one_side_only_land_where_each_says() {
        let me = PeerProcess::vouched(std::process::id()).unwrap();
        const N: usize = 3000; // more than one call's segments on the scattered side
        const LEN: usize = 256;
        let src: Vec<u8> = (0..N * LEN).map(|i| (i * 13 % 253) as u8).collect();
        // A fixed permutation of the pages: 1, 1 + 7, 1 + 14, ... modulo N (7 is prime to N).
        let perm: Vec<usize> = (0..N).map(|k| (1 + 7 * k) % N).collect();
        let far = Instant::now() + Duration::from_secs(30);
        for (scatter_local, scatter_remote) in [(true, false), (false, true), (true, true)] {
            let mut dst = vec![0u8; src.len()];
            let pieces: Vec<Piece> = (0..N)
                .map(|k| {
                    let (l, r) = (
                        if scatter_local { perm[k] } else { k },
                        if scatter_remote { perm[k] } else { k },
                    );
                    Piece {
                        local: dst.as_mut_ptr() as u64 + (l * LEN) as u64,
                        remote: src.as_ptr() as u64 + (r * LEN) as u64,
                        len: LEN,
                    }
                })
                .collect();
            // SAFETY: `dst` is ours for the call.
            let moved = unsafe { copy(&me, Way::Read, &pieces, far, None) }.unwrap();
            assert_eq!(moved, src.len() as u64);
            for p in &pieces {
                let at = (p.local - dst.as_ptr() as u64) as usize;
                let from = (p.remote - src.as_ptr() as u64) as usize;
                assert_eq!(
                    dst[at..at + LEN],
                    src[from..from + LEN],
                    "local scattered {scatter_local}, remote scattered {scatter_remote}"
                );
            }
        }
    }

    #[test]
    fn a_gathered_read_lands_every_scattered_piece_and_reads_only_inside_the_ranges() {
        let me = PeerProcess::vouched(std::process::id()).unwrap();
        const PAGES: usize = 4096;
        const LEN: usize = 256;
        // Two "ranges" back to back in one allocation; the request's pages are every
        // third page in a scattered order, some far apart (past the gap), one twice.
        let src: Vec<u8> = (0..2 * PAGES * LEN).map(|i| (i * 31 % 241) as u8).collect();
        let half = (PAGES * LEN) as u64;
        let base = src.as_ptr() as u64;
        let within = [(base, base + half), (base + half, base + 2 * half)];
        let mut pages: Vec<usize> = (0..2 * PAGES).step_by(3).collect();
        pages.extend([5000, 5000, 7000]);
        let n = pages.len();
        let mut dst = vec![0u8; n * LEN];
        let pieces: Vec<Piece> = (0..n)
            .map(|k| Piece {
                local: dst.as_mut_ptr() as u64 + (((k * 7) % n) * LEN) as u64,
                remote: base + (pages[(k * 11) % n] * LEN) as u64,
                len: LEN,
            })
            .collect();
        let far = Instant::now() + Duration::from_secs(30);
        // SAFETY: `dst` is ours for the call.
        let moved = unsafe { read_gathered(&me, &pieces, &within, far) }.unwrap();
        assert_eq!(moved, (n * LEN) as u64);
        for p in &pieces {
            let at = (p.local - dst.as_ptr() as u64) as usize;
            let from = (p.remote - base) as usize;
            assert_eq!(dst[at..at + LEN], src[from..from + LEN]);
        }
        // In three lanes (the spans make three calls or more), the same bytes land.
        let first = dst.clone();
        dst.fill(0);
        // SAFETY: `dst` is ours for the call; no two pieces' local ranges overlap.
        let moved = unsafe { read_gathered_in_lanes(&me, &pieces, &within, far, 3) }.unwrap();
        assert_eq!(moved, (n * LEN) as u64);
        assert_eq!(dst, first);
        // A piece longer than one call among small ones is read in parts, whole.
        let mut whole = vec![0u8; src.len()];
        let mut mixed = vec![Piece {
            local: whole.as_mut_ptr() as u64,
            remote: base,
            len: src.len() - 4096 * 64,
        }];
        mixed.extend((0..64usize).map(|k| {
            let at = src.len() - 4096 * 64 + k * 4096;
            Piece {
                local: whole.as_mut_ptr() as u64 + at as u64,
                remote: base + at as u64,
                len: 256,
            }
        }));
        assert!(mixed[0].len > BYTES_PER_CALL_MAX);
        // SAFETY: `whole` is ours for the call.
        let moved = unsafe { read_gathered(&me, &mixed, &within, far) }.unwrap();
        assert_eq!(moved, mixed.iter().map(|p| p.len as u64).sum::<u64>());
        for p in &mixed {
            let at = (p.local - whole.as_ptr() as u64) as usize;
            assert_eq!(whole[at..at + p.len], src[at..at + p.len]);
        }
        // A piece outside every range is read alone, and an unmapped one is a named error.
        let bad = [Piece {
            local: dst.as_mut_ptr() as u64,
            remote: 8,
            len: 64,
        }];
        // SAFETY: as above.
        let err = unsafe { read_gathered(&me, &bad, &within, far) }.unwrap_err();
        assert!(
            matches!(err, SameHostError::Copy { remote: 8, .. }),
            "{err}"
        );
        // A range that lies (its end unmapped) stops the read short, by name.
        let lie = [(base, u64::MAX)];
        let stray = [
            Piece {
                local: dst.as_mut_ptr() as u64,
                remote: base,
                len: 64,
            },
            Piece {
                local: dst.as_mut_ptr() as u64 + 64,
                remote: 8,
                len: 64,
            },
        ];
        // SAFETY: as above.
        let err = unsafe { read_gathered(&me, &stray, &lie, far) }.unwrap_err();
        assert!(matches!(err, SameHostError::Copy { .. }), "{err}");
    }

    #[test]
    fn a_copy_moves_every_piece_and_a_lying_address_is_a_named_error() {
        let me = PeerProcess::vouched(std::process::id()).unwrap();
        // Many pieces (more than one call's segments) and a piece larger than one call.
        let src: Vec<u8> = (0..(3 << 20)).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let mut pieces = Vec::new();
        for k in 0..2000usize {
            pieces.push(Piece {
                local: dst.as_mut_ptr() as u64 + (k * 512) as u64,
                remote: src.as_ptr() as u64 + (k * 512) as u64,
                len: 512,
            });
        }
        let rest = 2000 * 512;
        pieces.push(Piece {
            local: dst.as_mut_ptr() as u64 + rest as u64,
            remote: src.as_ptr() as u64 + rest as u64,
            len: src.len() - rest,
        });
        let far = Instant::now() + Duration::from_secs(30);
        // SAFETY: `dst` is ours for the call.
        let moved = unsafe { copy(&me, Way::Read, &pieces, far, None) }.unwrap();
        assert_eq!(moved, src.len() as u64);
        assert_eq!(dst, src);
        // A peer address that is not mapped: a named error, nothing of ours touched past it.
        let bad = [Piece {
            local: dst.as_mut_ptr() as u64,
            remote: 8,
            len: 64,
        }];
        // SAFETY: as above.
        let err = unsafe { copy(&me, Way::Read, &bad, far, None) }.unwrap_err();
        assert!(
            matches!(err, SameHostError::Copy { remote: 8, .. }),
            "{err}"
        );
        // A revoked lease writes nothing.
        let lease = Lease::new();
        lease.revoke();
        dst.fill(0);
        let w = [Piece {
            local: src.as_ptr() as u64,
            remote: dst.as_mut_ptr() as u64,
            len: 64,
        }];
        // SAFETY: as above.
        let err = unsafe { copy(&me, Way::Write, &w, far, Some(&lease)) }.unwrap_err();
        assert!(matches!(
            err,
            SameHostError::LeaseExpired {
                moved: 0,
                ago: None,
                ..
            }
        ));
        assert!(dst.iter().all(|&b| b == 0));
        // A past deadline moves nothing.
        // SAFETY: as above.
        let err = unsafe { copy(&me, Way::Write, &w, Instant::now(), None) }.unwrap_err();
        assert!(matches!(err, SameHostError::Timeout { moved: 0, .. }));
    }

    #[test]
    fn runs_cover_every_byte_once_in_order_and_none_is_over_its_share() {
        let pieces: Vec<Piece> = [5usize, 1, 17, 3, 3, 40, 1, 9]
            .iter()
            .scan(0u64, |at, &len| {
                let p = Piece {
                    local: 1000 + *at,
                    remote: 9000 + 2 * *at,
                    len,
                };
                *at += len as u64;
                Some(p)
            })
            .collect();
        let total: u64 = pieces.iter().map(|p| p.len as u64).sum();
        // Every piece's bytes, one per (local, remote) pair, in order.
        let bytes = |list: &[Piece]| -> Vec<(u64, u64)> {
            list.iter()
                .flat_map(|p| (0..p.len as u64).map(move |k| (p.local + k, p.remote + k)))
                .collect()
        };
        for share in [0, 1, 2, 7, 16, 40, 79, 200] {
            let runs = split_runs(&pieces, share);
            let share = share.max(1);
            assert_eq!(runs.len() as u64, total.div_ceil(share), "share {share}");
            assert!(runs
                .iter()
                .all(|r| !r.is_empty() && r.iter().all(|p| p.len > 0)));
            let sizes: Vec<u64> = runs
                .iter()
                .map(|r| r.iter().map(|p| p.len as u64).sum())
                .collect();
            // Every run full but the last.
            assert!(sizes[..sizes.len() - 1].iter().all(|&n| n == share));
            assert_eq!(bytes(&runs.concat()), bytes(&pieces), "share {share}");
        }
        assert!(split_runs(&[], 3).is_empty());
        assert_eq!(lanes_for(0), 1);
        assert_eq!(lanes_for(LANE_BYTES_MIN - 1), 1);
        assert!(lanes_for(u64::MAX) <= LANES_MAX);
    }

    #[test]
    fn a_copy_in_lanes_moves_every_piece_and_any_lanes_failure_is_the_answer() {
        let me = PeerProcess::vouched(std::process::id()).unwrap();
        let src: Vec<u8> = (0..(6 << 20) + 333).map(|i| (i * 7 % 251) as u8).collect();
        let far = Instant::now() + Duration::from_secs(30);
        // Scattered 64 KiB pieces both ways, in three lanes (a piece split on each boundary).
        const LEN: usize = 64 << 10;
        let n = src.len() / LEN;
        for way in [Way::Read, Way::Write] {
            let mut dst = vec![0u8; src.len()];
            let mut pieces: Vec<Piece> = (0..n)
                .map(|k| {
                    let (d, s) = ((k * 5) % n * LEN, k * LEN);
                    match way {
                        Way::Read => Piece {
                            local: dst.as_mut_ptr() as u64 + d as u64,
                            remote: src.as_ptr() as u64 + s as u64,
                            len: LEN,
                        },
                        Way::Write => Piece {
                            local: src.as_ptr() as u64 + s as u64,
                            remote: dst.as_mut_ptr() as u64 + d as u64,
                            len: LEN,
                        },
                    }
                })
                .collect();
            let tail = n * LEN;
            pieces.push(Piece {
                local: [dst.as_mut_ptr() as u64, src.as_ptr() as u64][(way == Way::Write) as usize]
                    + tail as u64,
                remote: [src.as_ptr() as u64, dst.as_mut_ptr() as u64]
                    [(way == Way::Write) as usize]
                    + tail as u64,
                len: src.len() - tail,
            });
            // SAFETY: `dst` is ours for the call, `src` only read.
            let moved = unsafe { copy_in_lanes(&me, way, &pieces, far, None, 3) }.unwrap();
            assert_eq!(moved, src.len() as u64);
            for k in 0..n {
                let (d, s) = ((k * 5) % n * LEN, k * LEN);
                assert_eq!(dst[d..d + LEN], src[s..s + LEN], "{way:?} piece {k}");
            }
            assert_eq!(dst[tail..], src[tail..]);
        }
        // A lying address in the last lane's run: the copy fails by name.
        let mut dst = vec![0u8; src.len()];
        let half = src.len() / 2;
        let pieces = [
            Piece {
                local: dst.as_mut_ptr() as u64,
                remote: src.as_ptr() as u64,
                len: half,
            },
            Piece {
                local: dst.as_mut_ptr() as u64 + half as u64,
                remote: 8,
                len: 64,
            },
        ];
        // SAFETY: as above.
        let err = unsafe { copy_in_lanes(&me, Way::Read, &pieces, far, None, 2) }.unwrap_err();
        assert!(
            matches!(err, SameHostError::Copy { remote: 8, .. }),
            "{err}"
        );
        // A revoked lease: no lane writes a byte.
        let lease = Lease::new();
        lease.revoke();
        let w = [Piece {
            local: src.as_ptr() as u64,
            remote: dst.as_mut_ptr() as u64,
            len: src.len(),
        }];
        dst.fill(0);
        // SAFETY: as above.
        let err = unsafe { copy_in_lanes(&me, Way::Write, &w, far, Some(&lease), 4) }.unwrap_err();
        assert!(
            matches!(err, SameHostError::LeaseExpired { moved: 0, .. }),
            "{err}"
        );
        assert!(dst.iter().all(|&b| b == 0));
    }

    #[test]
    fn the_process_holding_a_connection_is_verified_and_another_is_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dialed = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let (ours, theirs) = (dialed.local_addr().unwrap(), dialed.peer_addr().unwrap());
        // This process holds both ends: verified from either side.
        let me = std::process::id();
        assert_eq!(PeerProcess::verify(me, ours, theirs).unwrap().pid(), me);
        assert!(PeerProcess::verify(me, theirs, ours).is_ok());
        // A child that does not hold the socket is refused by name.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let err = PeerProcess::verify(child.id(), ours, theirs).unwrap_err();
        assert!(
            matches!(&err, SameHostError::NotVerified { detail, .. } if detail.contains("does not hold")),
            "{err}"
        );
        // A connection that does not exist, and no pid.
        let nowhere: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert!(PeerProcess::verify(me, ours, nowhere).is_err());
        assert!(PeerProcess::verify(0, ours, theirs).is_err());
        // An exited process: its pidfd says so.
        let vouched = PeerProcess::vouched(child.id()).unwrap();
        assert!(vouched.alive());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!vouched.alive());
        drop(accepted);
    }
}
