//! A peer's packed remote key, checked before UCX sees it.
//!
//! `ucp_ep_rkey_unpack` takes no length: UCX walks the bytes as its packed format says (a
//! little-endian `u64` map of the packing context's memory domains, a memory-type byte, then
//! for each domain in the map a size byte and that many bytes, then optional extensions),
//! and each domain's component reads its own fixed layout from where its bytes start. Two
//! ways a peer's bytes make *our* process take a signal inside UCX, both seen here with
//! UCX 1.13 and a real peer:
//!
//! - a key cut short (or a size byte raised) makes UCX read past the buffer and unpack
//!   whatever follows it in our heap;
//! - up to UCX 1.18, when one domain's key fails to unpack (a shared-memory segment that
//!   does not exist, a domain map naming another component), `ucp_ep_rkey_unpack` releases
//!   domain keys it never initialised and dies with SIGSEGV before it returns (fixed
//!   upstream in 1.19, "Keep md_map consistent with tl_rkey").
//!
//! So a key is first walked here ([`check_format`]: every domain's bytes inside the
//! buffer, a memory type this runtime moves), then handed to UCX padded with zeros (a
//! component that reads more than its domain's size byte says reads zeros, not our heap).
//! Where the loaded UCX still has the faulty cleanup, a peer's host keys are first
//! unpacked in a child process forked for that ([`vet`]), cut off from every peer first:
//! a key that kills the child is refused by name and never reaches this process's UCX. The child stays alive, holding
//! what it attached, until this process has unpacked the same keys, so a segment the child
//! found cannot vanish in between while the child holds it (a sysv segment cannot; a posix
//! one reached through the peer's file descriptor can, if the peer closes it in that
//! window: left open, see ARCHITECTURE).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use super::{maps, sys};

/// Zero bytes after a key handed to UCX: at least the most a size byte can say.
pub(crate) const PAD_BYTES: usize = 256;

/// `UCS_MEMORY_TYPE_HOST`, the memory type byte of a host key.
pub(crate) const MEMORY_TYPE_HOST: u8 = 0;

/// The memory types a key may carry: `UCS_MEMORY_TYPE_HOST` and `UCS_MEMORY_TYPE_CUDA`,
/// the two this runtime moves (UCX indexes tables by this byte).
const MEMORY_TYPES: [u8; 2] = [MEMORY_TYPE_HOST, 1];

/// The first UCX whose failed unpack cleans up only what it unpacked.
const CLEANUP_FIXED: (u32, u32) = (1, 19);

/// How long the vetting of a peer's keys may take, every child it makes together.
pub(crate) const VET_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the first child of a vetting may take before a second is made for the rest of
/// [`VET_TIMEOUT`]. A child that inherited a lock held at the fork (see
/// [`VetError::Undecided`]) never gets past it, while a new fork, made once that thread has
/// let go, usually does. An unpacking takes milliseconds and a fork of a large engine about
/// a second at worst (seen once on a busy core), so an honest peer's keys are not turned
/// away for one unlucky fork.
pub(crate) const VET_FIRST_TRY: Duration = Duration::from_secs(2);
const _: () = assert!(VET_FIRST_TRY.as_millis() < VET_TIMEOUT.as_millis());

/// The longest a vetting child waits for its release (it also dies with this process).
const VET_HOLD_MS: i32 = 60_000;

/// What a well-formed key says about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeyShape {
    /// The memory type byte (0 host, 1 CUDA).
    pub(crate) memory_type: u8,
    /// How many memory domains it carries keys for.
    pub(crate) domains: u32,
}

/// What is wrong with a packed key's format.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum KeyFormatError {
    /// Shorter than the domain map and the memory type.
    #[error("{len} bytes, shorter than its domain map and memory type (9)")]
    TooShort {
        /// The key's length.
        len: usize,
    },
    /// A memory type this runtime does not move.
    #[error("memory type {found} (host is 0, CUDA 1; no other is moved)")]
    MemoryType {
        /// The byte found.
        found: u8,
    },
    /// A domain's size byte or bytes lie past the key's end.
    #[error("cut short: domain {domain}'s bytes would end at {end}, the key has {len}")]
    CutShort {
        /// The domain (its bit in the map).
        domain: u32,
        /// Where its bytes would end.
        end: usize,
        /// The key's length.
        len: usize,
    },
}

/// Walks a packed key: the domain map, the memory type, then every domain's size byte and
/// bytes, all inside `packed`. Extensions after the last domain are UCX's own (it reads
/// them only where a length is known) and are allowed.
pub(crate) fn check_format(packed: &[u8]) -> Result<KeyShape, KeyFormatError> {
    let len = packed.len();
    let (Some(map), Some(&memory_type)) = (packed.first_chunk::<8>(), packed.get(8)) else {
        return Err(KeyFormatError::TooShort { len });
    };
    let map = u64::from_le_bytes(*map);
    if !MEMORY_TYPES.contains(&memory_type) {
        return Err(KeyFormatError::MemoryType { found: memory_type });
    }
    let mut at = 9usize;
    for domain in (0..64u32).filter(|d| map & (1 << d) != 0) {
        let cut = |end| KeyFormatError::CutShort { domain, end, len };
        let size = *packed.get(at).ok_or(cut(at + 1))?;
        let end = at + 1 + usize::from(size);
        if end > len {
            return Err(cut(end));
        }
        at = end;
    }
    Ok(KeyShape {
        memory_type,
        domains: map.count_ones(),
    })
}

/// `packed` followed by [`PAD_BYTES`] zeros: what UCX is handed.
pub(crate) fn padded(packed: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(packed.len() + PAD_BYTES);
    out.extend_from_slice(packed);
    out.resize(packed.len() + PAD_BYTES, 0);
    out
}

/// Whether a UCX of this version must have its peers' keys vetted in a child first.
pub(crate) fn needs_vetting(version: (u32, u32, u32)) -> bool {
    (version.0, version.1) < CLEANUP_FIXED
}

/// Why vetting failed.
#[derive(Debug)]
pub(crate) enum VetError {
    /// The keys are refused: unpacking them killed the child, or UCX refused one there.
    Refused(String),
    /// The child neither answered nor died within its bound. Nothing certain was learnt: a
    /// key can stall UCX's unpacking, but so can a lock of UCX's memory hooks that another
    /// thread of ours held at the fork (the child inherits it held, and no one there
    /// releases it), so an honest peer's keys may see this too.
    Undecided(String),
    /// The child could not be made (fork, pipe, `/proc/self/maps`): nothing was learnt.
    Unavailable(String),
}

/// A vetting child that unpacked every key and now holds them, until dropped.
pub(crate) struct Held {
    pid: libc::pid_t,
    /// Closing it releases the child.
    _release: OwnedFd,
}

impl Drop for Held {
    fn drop(&mut self) {
        // The child exits when its release pipe closes; make sure, and reap it. A host
        // process's own SIGCHLD handler may have reaped it already (ECHILD): harmless.
        // SAFETY: `pid` is our child, not yet reaped by us; kill and waitpid take plain ints.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

fn pipe() -> Result<(OwnedFd, OwnedFd), VetError> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors `pipe2` writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(VetError::Unavailable(format!("pipe: {e}")));
    }
    // SAFETY: both descriptors were just opened and are owned here only.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Unpacks `keys` (each already [`padded`]) on `ep` in a child process forked for it. `Ok`
/// holds the child, which unpacked every key and keeps what it attached until the [`Held`]
/// is dropped; `Err` says how the child failed: a signal (the key would have killed this
/// process) or a status UCX returned ([`VetError::Refused`]), or no answer before
/// `deadline` ([`VetError::Undecided`]).
pub(crate) fn vet(
    api: &'static sys::Api,
    ep: sys::ucp_ep_h,
    keys: &[&[u8]],
    deadline: Instant,
) -> Result<Held, VetError> {
    let ptrs: Vec<*const std::ffi::c_void> = keys.iter().map(|k| k.as_ptr().cast()).collect();
    let (answer_r, answer_w) = pipe()?;
    let (release_r, release_w) = pipe()?;
    let unpack = api.ucp_ep_rkey_unpack;
    // No other UCX thread of this process maps anything between the snapshot and the fork.
    let guard = maps::hold();
    let shared =
        maps::shared().map_err(|e| VetError::Unavailable(format!("/proc/self/maps: {e}")))?;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: fork in a multithreaded process: the child runs only async-signal-safe libc
    // calls and UCX's unpack on the thread that owns `ep` (whose locks no other thread
    // takes), allocates nothing on the Rust side, and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let e = std::io::Error::last_os_error();
        return Err(VetError::Unavailable(format!("fork: {e}")));
    }
    if pid == 0 {
        // SAFETY: the child (see above).
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != parent {
                libc::_exit(3);
            }
            // Cut the child off from every peer: it is a copy of a live UCX worker, and
            // unpacking may send (a wireup for a lane UCX emulates with active messages),
            // which would reach the real peer in our name. No descriptor but stderr and
            // its two pipes stays open, and every shared mapping (UCX's FIFOs, the peers'
            // segments) becomes private zeros; what the unpacking maps anew is its own.
            close_from(3, [answer_w.as_raw_fd(), release_r.as_raw_fd()]);
            // What UCX says in here is about the sandbox (segments it cannot attach, its
            // wakeup fd closed above), not about anything real: the verdict is the exit
            // status. Its stdout (UCX logs there) and stderr go to /dev/null so that users
            // never read it.
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
            if null >= 0 {
                libc::dup2(null, 1);
                libc::dup2(null, 2);
                libc::close(null);
            }
            // The raw system call, not libc's `mmap`: UCX hooks that symbol, and its hook
            // takes locks another thread of the parent may have held at the fork.
            for m in &shared {
                libc::syscall(
                    libc::SYS_mmap,
                    m.start as usize,
                    (m.end - m.start) as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    -1i32,
                    0usize,
                );
            }
            for &p in &ptrs {
                let mut handle = std::ptr::null_mut();
                if unpack(ep, p, &mut handle) != sys::UCS_OK {
                    libc::_exit(2);
                }
            }
            let ok = b'k';
            libc::write(answer_w.as_raw_fd(), (&ok as *const u8).cast(), 1);
            let mut wait = libc::pollfd {
                fd: release_r.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            libc::poll(&mut wait, 1, VET_HOLD_MS);
            libc::_exit(0);
        }
    }
    drop(guard);
    drop(answer_w);
    drop(release_r);
    let held = Held {
        pid,
        _release: release_w,
    };
    match read_answer(&answer_r, deadline) {
        Ok(true) => Ok(held),
        Ok(false) => {
            // The child is gone without answering: how?
            let mut status = 0;
            // SAFETY: our child; `status` is written by waitpid.
            let reaped = unsafe { libc::waitpid(pid, &mut status, 0) } == pid;
            std::mem::forget(held);
            Err(VetError::Refused(if !reaped {
                "the vetting process ended without unpacking every key".into()
            } else if libc::WIFSIGNALED(status) {
                let signal = libc::WTERMSIG(status);
                format!(
                    "unpacking it killed the vetting process with signal {signal} ({}): \
                     in this process it would have killed us",
                    signal_name(signal)
                )
            } else {
                match libc::WEXITSTATUS(status) {
                    2 => "UCX could not unpack it (in a vetting process)".into(),
                    code => format!("the vetting process exited with {code}"),
                }
            }))
        }
        Err(e) => Err(e), // `held` dropped: killed and reaped.
    }
}

/// A vetting that began at `started`: `vet_by(deadline)` makes one child, answering by that
/// deadline. The first child gets [`VET_FIRST_TRY`]; if it ends undecided, a second gets the
/// rest of [`VET_TIMEOUT`]. A child's refusal or success is final.
pub(crate) fn vet_again_once<T>(
    started: Instant,
    mut vet_by: impl FnMut(Instant) -> Result<T, VetError>,
) -> Result<T, VetError> {
    match vet_by(started + VET_FIRST_TRY) {
        Err(VetError::Undecided(detail)) => {
            tracing::debug!(%detail, "a vetting process stalled (a lock held at the fork, or the keys): vetting again in a new one");
            vet_by(started + VET_TIMEOUT)
        }
        done => done,
    }
}

/// Closes every descriptor from `first` on but `keep` (in a forked child: only syscalls).
fn close_from(first: i32, keep: [i32; 2]) {
    let (a, b) = (keep[0].min(keep[1]), keep[0].max(keep[1]));
    for (lo, hi) in [(first, a - 1), (a + 1, b - 1), (b + 1, i32::MAX)] {
        if lo > hi {
            continue;
        }
        // SAFETY: close_range takes plain integers; a failure (old kernel) falls back.
        let done = unsafe { libc::syscall(libc::SYS_close_range, lo as u32, hi as u32, 0) } == 0;
        if !done {
            for fd in lo..=hi.min(65_535) {
                // SAFETY: closing a descriptor number, open or not.
                unsafe { libc::close(fd) };
            }
        }
    }
}

/// `Ok(true)` when the child wrote its byte, `Ok(false)` when its end closed first.
fn read_answer(answer: &OwnedFd, deadline: Instant) -> Result<bool, VetError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(VetError::Undecided(format!(
                "the vetting process did not unpack the keys within {VET_TIMEOUT:?}"
            )));
        }
        let mut wait = libc::pollfd {
            fd: answer.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut wait, 1, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(VetError::Unavailable(format!("poll: {e}")));
        }
        if n == 0 {
            continue;
        }
        let mut byte = 0u8;
        // SAFETY: one byte into `byte`.
        let got = unsafe { libc::read(answer.as_raw_fd(), (&mut byte as *mut u8).cast(), 1) };
        if got < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return Ok(got == 1 && byte == b'k');
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGABRT => "SIGABRT",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        _ => "another signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of UCX 1.13's key for a host region here: domains 0, 1, 2 and 4, the
    /// third with 12 bytes (a sysv segment id and its owner's address).
    fn honest() -> Vec<u8> {
        let mut k = 0x17u64.to_le_bytes().to_vec();
        k.extend([0, 0, 0, 12]);
        k.extend([0x22, 0, 0xc8, 0, 0, 0x30, 0x18, 0x99, 0x5f, 0x7f, 0, 0]);
        k.push(0);
        k
    }

    #[test]
    fn a_child_that_never_answers_is_undecided_and_one_that_ends_silent_is_not_ok() {
        let (r, w) = pipe().map_err(|e| format!("{e:?}")).unwrap();
        let deadline = Instant::now() + Duration::from_millis(20);
        // The writer stays open and silent: a child stuck in its unpacking.
        match read_answer(&r, deadline) {
            Err(VetError::Undecided(detail)) => assert!(detail.contains("did not unpack")),
            other => panic!("expected Undecided, got {other:?}"),
        }
        // The writer closes without a word: a child that died (how is for waitpid).
        drop(w);
        let later = Instant::now() + Duration::from_secs(5);
        assert!(matches!(read_answer(&r, later), Ok(false)));
        let (r, w) = pipe().map_err(|e| format!("{e:?}")).unwrap();
        // SAFETY: one byte from a live local.
        let ok = b'k';
        assert_eq!(
            unsafe { libc::write(w.as_raw_fd(), (&ok as *const u8).cast(), 1) },
            1
        );
        assert!(matches!(read_answer(&r, later), Ok(true)));
    }

    #[test]
    fn a_stalled_vetting_gets_one_more_child_for_the_rest_of_the_bound_and_no_more() {
        let started = Instant::now();
        let stalled = || VetError::Undecided("stuck".into());
        // Undecided, then undecided again: two children, the second by the whole bound.
        let mut asked = Vec::new();
        let r: Result<(), _> = vet_again_once(started, |by| {
            asked.push(by);
            Err(stalled())
        });
        assert!(matches!(r, Err(VetError::Undecided(_))), "{r:?}");
        assert_eq!(
            asked,
            [started + VET_FIRST_TRY, started + VET_TIMEOUT],
            "a first try, then the rest of the bound"
        );
        // Undecided, then done: the second child's answer stands.
        let mut n = 0;
        let r = vet_again_once(started, |_| {
            n += 1;
            if n == 1 {
                Err(stalled())
            } else {
                Ok(n)
            }
        });
        assert_eq!(r.ok(), Some(2));
        // A refusal, a success, or no child at all is final: one child only.
        for first in [
            Err(VetError::Refused("killed".into())),
            Ok(()),
            Err(VetError::Unavailable("fork".into())),
        ] {
            let mut calls = 0;
            let mut first = Some(first);
            let _ = vet_again_once(started, |_| {
                calls += 1;
                first.take().unwrap_or(Ok(()))
            });
            assert_eq!(calls, 1);
        }
    }

    #[test]
    fn an_honest_key_walks_to_its_end() {
        assert_eq!(
            check_format(&honest()),
            Ok(KeyShape {
                memory_type: 0,
                domains: 4
            })
        );
        // Extensions after the last domain are UCX's own.
        let mut longer = honest();
        longer.extend([1, 2, 3]);
        assert!(check_format(&longer).is_ok());
    }

    #[test]
    fn every_cut_and_every_raised_size_is_refused() {
        let key = honest();
        for n in 0..key.len() {
            let err = check_format(&key[..n]).unwrap_err();
            assert!(
                matches!(
                    err,
                    KeyFormatError::CutShort { .. } | KeyFormatError::TooShort { .. }
                ),
                "{n}: {err}"
            );
        }
        for at in [9, 10, 11, 24] {
            let mut k = key.clone();
            k[at] = 0xff;
            let err = check_format(&k).unwrap_err();
            assert!(matches!(err, KeyFormatError::CutShort { .. }), "{at}");
        }
    }

    #[test]
    fn a_memory_type_no_one_moves_is_refused() {
        let mut k = honest();
        k[8] = 7;
        assert_eq!(
            check_format(&k),
            Err(KeyFormatError::MemoryType { found: 7 })
        );
        k[8] = 1;
        assert_eq!(check_format(&k).map(|s| s.memory_type), Ok(1));
    }

    #[test]
    fn a_map_of_every_domain_needs_64_sizes() {
        let mut k = u64::MAX.to_le_bytes().to_vec();
        k.push(0);
        k.extend([0u8; 63]);
        assert!(matches!(
            check_format(&k),
            Err(KeyFormatError::CutShort { domain: 63, .. })
        ));
        k.push(0);
        assert_eq!(check_format(&k).map(|s| s.domains), Ok(64));
    }

    #[test]
    fn padding_adds_zeros_only() {
        let p = padded(&honest());
        assert_eq!(&p[..honest().len()], &honest()[..]);
        assert_eq!(p.len(), honest().len() + PAD_BYTES);
        assert!(p[honest().len()..].iter().all(|&b| b == 0));
    }

    #[test]
    fn only_versions_with_the_faulty_cleanup_vet() {
        assert!(needs_vetting((1, 13, 1)));
        assert!(needs_vetting((1, 18, 0)));
        assert!(!needs_vetting((1, 19, 0)));
        assert!(!needs_vetting((1, 22, 0)));
    }
}
