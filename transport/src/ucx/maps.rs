//! Which shared mappings this process has (`/proc/self/maps`), to check a peer's remote key
//! against the memory it really opens.
//!
//! On the shared-memory transports (posix, sysv, xpmem), unpacking a peer's key maps the
//! peer's segment into our address space, and a put or get is a `memcpy` at
//! `mapping + (remote address - segment base)` with no bound: a peer that advertises a
//! range its key does not cover makes *us* write or read outside the mapping (a signal, or
//! a silent write into our own heap). [`check_mapped`] closes that: the range, seen through
//! the key (`ucp_rkey_ptr`), must lie inside one shared mapping that the key's unpacking
//! created (or, for a peer in this very process, at its own address), else the key is
//! refused before anything is posted.

use std::sync::Mutex;

/// One mapping: `[start, end)` in this address space, of the file `(dev, inode)`. The file
/// tells a mapping from another that took its place at the same addresses (a segment
/// unmapped by another thread between two snapshots, the unpacking's at the same spot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mapping {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) dev: u64,
    pub(crate) inode: u64,
}

/// Serializes snapshot, unpack, snapshot across every UCX thread of the process, so the
/// mappings new between two snapshots are those one unpacking made. Also held across a
/// key-vetting fork and around `ucp_init`/`ucp_cleanup`, so that the fork never copies
/// UCX's memory-event lock held by a context coming or going on another thread.
static UNPACK: Mutex<()> = Mutex::new(());

/// Holds [`UNPACK`] (a panic elsewhere under it left nothing to repair: it guards no data).
pub(crate) fn hold() -> std::sync::MutexGuard<'static, ()> {
    UNPACK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The process's shared mappings (`s` in the permissions), sorted by start. `Err` where
/// `/proc/self/maps` cannot be read (then nothing reached by pointer can be checked).
pub(crate) fn shared() -> std::io::Result<Vec<Mapping>> {
    let text = std::fs::read_to_string("/proc/self/maps")?;
    Ok(parse_shared(&text))
}

/// The shared mappings of a `/proc/<pid>/maps` text; lines that do not parse are skipped.
pub(crate) fn parse_shared(text: &str) -> Vec<Mapping> {
    let mut out: Vec<Mapping> = text
        .lines()
        .filter_map(|line| {
            let mut words = line.split_ascii_whitespace();
            let (start, end) = words.next()?.split_once('-')?;
            let perms = words.next()?;
            if perms.as_bytes().get(3) != Some(&b's') {
                return None;
            }
            let _offset = words.next()?;
            let (major, minor) = words.next()?.split_once(':')?;
            let dev = (u64::from_str_radix(major, 16).ok()? << 32)
                | u64::from_str_radix(minor, 16).ok()?;
            let inode = words.next()?.parse::<u64>().ok()?;
            let start = u64::from_str_radix(start, 16).ok()?;
            let end = u64::from_str_radix(end, 16).ok()?;
            (start < end).then_some(Mapping {
                start,
                end,
                dev,
                inode,
            })
        })
        .collect();
    out.sort_by_key(|m| m.start);
    out
}

/// Checks `[ptr, ptr + len)`, the peer's range `[addr, addr + len)` as seen through its
/// key, against the shared mappings before (`old`) and after (`new`) the key was unpacked:
/// it must lie inside one mapping that is new, or, when `ptr == addr` (a peer in this
/// process, whose segment needs no second mapping), inside one shared mapping. Adjacent
/// mappings are not merged: one segment is one mapping. `Err` says why not.
pub(crate) fn check_mapped(
    old: &[Mapping],
    new: &[Mapping],
    addr: u64,
    ptr: u64,
    len: u64,
) -> Result<(), String> {
    let Some(end) = ptr.checked_add(len) else {
        return Err(format!("{len} bytes from {ptr:#x} overflow"));
    };
    let inside = |m: &&Mapping| m.start <= ptr && end <= m.end;
    let Some(m) = new.iter().find(inside) else {
        return Err(format!(
            "the key maps [{addr:#x}, +{len}) to [{ptr:#x}, {end:#x}), which is not inside one \
             shared mapping of the peer's segment"
        ));
    };
    if ptr == addr || !old.contains(m) {
        return Ok(());
    }
    Err(format!(
        "the key maps [{addr:#x}, +{len}) into [{:#x}, {:#x}), a mapping that existed before \
         the key was unpacked (not the peer's segment)",
        m.start, m.end
    ))
}

/// Checks `[ptr, ptr + len)`, the peer's range `[addr, addr + len)` as seen through its
/// key, against the device allocation `[start, start + size)` that holds `ptr`.
pub(crate) fn check_device(
    start: u64,
    size: u64,
    addr: u64,
    ptr: u64,
    len: u64,
) -> Result<(), String> {
    let inside = ptr >= start
        && ptr
            .checked_add(len)
            .zip(start.checked_add(size))
            .is_some_and(|(end, limit)| end <= limit);
    if inside {
        return Ok(());
    }
    Err(format!(
        "the key maps [{addr:#x}, +{len}) to device memory at {ptr:#x}, past the end of the \
         device allocation [{start:#x}, +{size}) it points into"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0000000-55d0c0021000 r--p 00000000 fd:00 123 /usr/bin/handoff
7f0000000000-7f0000400000 rw-s 00000000 00:19 777 /dev/shm/ucx_posix_1 (deleted)
7f0000400000-7f0000401000 rw-p 00000000 00:00 0
7f1000000000-7f1000100000 rw-s 00000000 00:01 9 /memfd:uct_posix_mm (deleted)
garbage line
";

    fn m(start: u64, end: u64) -> Mapping {
        Mapping {
            start,
            end,
            dev: 0,
            inode: 0,
        }
    }

    #[test]
    fn parses_only_shared_mappings() {
        assert_eq!(
            parse_shared(MAPS),
            vec![
                Mapping {
                    dev: 0x19,
                    inode: 777,
                    ..m(0x7f00_0000_0000, 0x7f00_0040_0000)
                },
                Mapping {
                    dev: 0x1,
                    inode: 9,
                    ..m(0x7f10_0000_0000, 0x7f10_0010_0000)
                }
            ]
        );
    }

    #[test]
    fn a_range_inside_a_new_mapping_passes_and_every_lie_is_refused() {
        let old = vec![m(0x1000, 0x9000)];
        let new = vec![m(0x1000, 0x9000), m(0x10000, 0x20000)];
        // Inside the mapping the unpacking made.
        assert!(check_mapped(&old, &new, 0xa000, 0x10000, 0x10000).is_ok());
        assert!(check_mapped(&old, &new, 0xa000, 0x18000, 0x100).is_ok());
        // Past its end, below its start, far away, overflowing.
        assert!(check_mapped(&old, &new, 0xa000, 0x10000, 0x10001).is_err());
        assert!(check_mapped(&old, &new, 0xa000, 0xf000, 0x100).is_err());
        assert!(check_mapped(&old, &new, 0xa000, 0x7000_0000, 0x100).is_err());
        assert!(check_mapped(&old, &new, 0xa000, u64::MAX - 4, 0x100).is_err());
        // Into a shared mapping that was there before (another peer's, our own FIFO).
        assert!(check_mapped(&old, &new, 0xa000, 0x2000, 0x100).is_err());
        // A peer in this process: its own address, in an existing shared mapping.
        assert!(check_mapped(&old, &new, 0x2000, 0x2000, 0x100).is_ok());
        assert!(check_mapped(&old, &new, 0x2000, 0x2000, 0x8000).is_err());
        // Another file at the very addresses of one that was there before (unmapped by
        // another thread meanwhile): new, the peer's segment.
        let replaced = vec![Mapping {
            inode: 5,
            ..m(0x1000, 0x9000)
        }];
        assert!(check_mapped(&old, &replaced, 0xa000, 0x2000, 0x100).is_ok());
    }

    #[test]
    fn a_device_range_must_fit_the_allocation_it_points_into() {
        assert!(check_device(0x1000, 0x1000, 0x9000, 0x1000, 0x1000).is_ok());
        assert!(check_device(0x1000, 0x1000, 0x9000, 0x1800, 0x800).is_ok());
        assert!(check_device(0x1000, 0x1000, 0x9000, 0x1800, 0x801).is_err());
        assert!(check_device(0x1000, 0x1000, 0x9000, 0xfff, 0x10).is_err());
        assert!(check_device(0x1000, 0x1000, 0x9000, u64::MAX - 1, 0x10).is_err());
        assert!(check_device(u64::MAX - 1, 0x10, 0x9000, u64::MAX - 1, 0x1).is_err());
    }
}
