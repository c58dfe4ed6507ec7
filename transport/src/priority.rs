//! The runtime's threads ahead of an engine's busy ones.
//!
//! An engine's scheduler loop spins on its core, and its compute fills the others. A
//! runtime thread woken by a peer's message (the one that ends a transfer, a heartbeat)
//! then waits for a core behind them: milliseconds on a loaded box, tens of them at the
//! tail on a small one. Our threads do little work per wake, so an engine's runtime asks
//! the kernel for a better nice value than the engine's (`nice` −10 by default in the
//! Python package), where the process may: it takes `CAP_SYS_NICE` or an `RLIMIT_NICE`
//! that allows it. Where it may not, the threads keep the priority they were born with,
//! and the first refusal is logged once.

use std::sync::atomic::{AtomicBool, Ordering};

/// The nice value the Python package gives its runtime threads unless told otherwise.
pub const THREAD_NICE_DEFAULT: i32 = -10;

/// Nice values run from -20 (first) to 19 (last).
pub const NICE_RANGE: std::ops::RangeInclusive<i32> = -20..=19;

static REFUSAL_LOGGED: AtomicBool = AtomicBool::new(false);

/// The calling thread's id: with `PRIO_PROCESS`, Linux's priority calls take a thread id
/// and act on that thread only.
fn this_thread() -> libc::id_t {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as libc::id_t }
}

/// Sets the calling thread's nice value. Out-of-range values are clamped to
/// [`NICE_RANGE`].
pub fn set_this_thread_nice(nice: i32) -> std::io::Result<()> {
    let nice = nice.clamp(*NICE_RANGE.start(), *NICE_RANGE.end());
    // SAFETY: changes this thread's nice value only.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, this_thread(), nice) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What a runtime thread calls first: takes `nice` when given; a refusal leaves the
/// thread as it is and is logged once per process.
pub fn apply(nice: Option<i32>, thread: &str) {
    let Some(nice) = nice else {
        return;
    };
    if let Err(e) = set_this_thread_nice(nice) {
        if !REFUSAL_LOGGED.swap(true, Ordering::Relaxed) {
            tracing::info!(
                nice,
                thread,
                error = %e,
                "runtime threads keep the engine's priority: the process may not take this \
                 nice value (it needs CAP_SYS_NICE or RLIMIT_NICE); thread_nice=None silences this"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's nice value (-1 is a value too: errno tells).
    fn this_thread_nice() -> std::io::Result<i32> {
        // SAFETY: errno is this thread's; getpriority only reads.
        unsafe { *libc::__errno_location() = 0 };
        let n = unsafe { libc::getpriority(libc::PRIO_PROCESS, this_thread()) };
        let err = std::io::Error::last_os_error();
        if n == -1 && err.raw_os_error().unwrap_or(0) != 0 {
            return Err(err);
        }
        Ok(n)
    }

    #[test]
    fn a_thread_takes_a_nice_value_of_its_own() {
        let before = this_thread_nice().unwrap();
        // A higher nice value (lower priority) needs no privilege.
        let child = std::thread::spawn(|| {
            apply(Some(7), "test");
            this_thread_nice().unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(child, 7);
        assert_eq!(
            this_thread_nice().unwrap(),
            before,
            "only that thread changed"
        );
    }

    #[test]
    fn out_of_range_values_are_clamped() {
        let got = std::thread::spawn(|| {
            set_this_thread_nice(99).unwrap();
            this_thread_nice().unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(got, 19);
    }
}
