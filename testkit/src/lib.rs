//! What a test does when this machine lacks what its real part needs: it fails, unless the
//! run names that need as one it may skip; then it says so, past the test harness's
//! capture, and records one line for the run's summary.
//!
//! - `HANDOFF_SKIP`: the needs a run may skip, comma-separated (`ucx`, `gpu`, `netns`,
//!   `pyzmq`, `lan`, `promtool`, `etcd`, or `all`). Unset, it is `gpu`: machines without a GPU are the common case;
//!   `scripts/test.sh` adds `gpu` on machines without an NVIDIA driver.
//! - `HANDOFF_SKIP_LOG`: a file each skip appends one line to (`need<TAB>test<TAB>why`);
//!   `scripts/test.sh` ends with one line that groups them.
//!
//! A test that reports `ok` after skipping its real part without being allowed to is the
//! failure this exists to prevent: `cargo test` on a machine without UCX used to pass its
//! UCX tests in no time.

pub mod etcd;

use std::fmt;
use std::io::Write;

/// What a test's real part needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// libucp (Debian `libucx0`, or `HANDOFF_UCX_LIB`).
    Ucx,
    /// An NVIDIA GPU, its driver, and (for the CUDA data plane) a CUDA-capable UCX.
    Gpu,
    /// Root, `ip` and `nft`, to make network namespaces and cut them.
    Netns,
    /// Python's `zmq` (pyzmq), for interop with real libzmq.
    Pyzmq,
    /// A network interface besides loopback, with a route.
    Lan,
    /// Prometheus's `promtool` (Debian `prometheus`), to check exposed metrics.
    Promtool,
    /// The `etcd` server (Debian `etcd-server`), for discovery on etcd.
    Etcd,
}

impl Need {
    /// Its name in `HANDOFF_SKIP`.
    pub fn name(self) -> &'static str {
        match self {
            Need::Ucx => "ucx",
            Need::Gpu => "gpu",
            Need::Netns => "netns",
            Need::Pyzmq => "pyzmq",
            Need::Lan => "lan",
            Need::Promtool => "promtool",
            Need::Etcd => "etcd",
        }
    }
}

impl fmt::Display for Need {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether this run may skip tests that need `need` (`HANDOFF_SKIP`, default `gpu`).
pub fn may_skip(need: Need) -> bool {
    allowed(std::env::var("HANDOFF_SKIP").ok().as_deref(), need)
}

fn allowed(list: Option<&str>, need: Need) -> bool {
    list.unwrap_or("gpu")
        .split(',')
        .map(str::trim)
        .any(|n| n == need.name() || n == "all")
}

/// `test` cannot run its real part here because `why` (it lacks `need`). Returns if the run
/// allows that skip, after saying so and recording it; panics otherwise, saying how to
/// allow it or what to install.
pub fn skip(need: Need, test: &str, why: &str) {
    if !may_skip(need) {
        panic!(
            "{test} cannot run its real part here: {why}. Install what it needs (scripts/test.sh \
             does, as root), or let this run skip it: HANDOFF_SKIP={need}"
        );
    }
    let line = format!("SKIP ({need}) {test}: {why}\n");
    // Straight to the process's stderr: libtest captures only the `print!` macros.
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Ok(path) = std::env::var("HANDOFF_SKIP_LOG") {
        record_skip(std::path::Path::new(&path), need, test, why);
    }
}

/// Appends `need<TAB>test<TAB>why` to the run's skip log, as one write: tests of several
/// threads and processes append at once, and `writeln!` writes each piece of its format
/// apart (seen: "gpugpu: 1 test(s)" in a run's summary), where one `O_APPEND` write of a
/// short line stays whole.
fn record_skip(path: &std::path::Path, need: Need, test: &str, why: &str) {
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let why = why.replace(['\t', '\n'], " ");
        let record = format!("{need}\t{test}\t{why}\n");
        let _ = f.write_all(record.as_bytes());
    }
}

/// [`skip`] for the test running on this thread (libtest names each test's thread after
/// the test).
pub fn skip_this(need: Need, why: &str) {
    let thread = std::thread::current();
    skip(need, thread.name().unwrap_or("a test"), why)
}

/// The `VmFlags` of this process's mapping that holds `addr` (`/proc/self/smaps`): `dc`
/// (not inherited by a fork), `hg` (huge pages asked for), ...; empty when none holds it.
pub fn vm_flags(addr: usize) -> String {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = a <= addr && addr < b;
                    continue;
                }
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.trim().to_string();
            }
        }
    }
    String::new()
}

/// How many cases a property test runs: `PROPTEST_CASES` when set (a deeper run on demand,
/// e.g. `PROPTEST_CASES=200000 cargo test -p handoff-actors --test machine_props`), else
/// `default`, the number `cargo test` runs every time.
pub fn proptest_cases(default: u32) -> u32 {
    cases_from(std::env::var("PROPTEST_CASES").ok().as_deref(), default)
}

fn cases_from(var: Option<&str>, default: u32) -> u32 {
    var.and_then(|v| v.trim().parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proptest_cases_come_from_the_variable_when_it_is_a_count() {
        assert_eq!(cases_from(None, 512), 512);
        assert_eq!(cases_from(Some("200000"), 512), 200_000);
        assert_eq!(cases_from(Some(" 64 "), 512), 64);
        assert_eq!(cases_from(Some("many"), 512), 512, "not a number");
        assert_eq!(cases_from(Some("0"), 512), 512, "zero would test nothing");
    }

    #[test]
    fn only_gpu_may_be_skipped_unless_the_run_says_more() {
        assert!(allowed(None, Need::Gpu));
        assert!(!allowed(None, Need::Ucx));
        assert!(!allowed(Some(""), Need::Gpu));
        assert!(allowed(Some("netns, ucx"), Need::Ucx));
        assert!(!allowed(Some("netns,ucx"), Need::Pyzmq));
        assert!(allowed(Some("all"), Need::Pyzmq));
    }

    #[test]
    fn skips_recorded_at_once_from_many_threads_stay_whole_lines() {
        let path = std::env::temp_dir().join(format!("handoff-skips-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        std::thread::scope(|s| {
            for t in 0..8 {
                let path = &path;
                s.spawn(move || {
                    for i in 0..200 {
                        record_skip(path, Need::Gpu, &format!("t{t}-{i}"), "no\tdriver\nhere");
                    }
                });
            }
        });
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 8 * 200);
        for line in lines {
            let fields: Vec<&str> = line.split('\t').collect();
            assert_eq!(fields.len(), 3, "{line:?}");
            assert_eq!(fields[0], "gpu", "{line:?}");
            assert!(fields[1].starts_with('t'), "{line:?}");
            assert_eq!(fields[2], "no driver here", "{line:?}");
        }
    }
}
