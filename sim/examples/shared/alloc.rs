//! The examples' allocator: mimalloc, asked for alignment only when a layout needs more
//! than every mimalloc block has.
//!
//! `mimalloc::MiMalloc` sends every allocation through `mi_malloc_aligned`, whose fast path
//! covers only blocks of at most 1 KiB; larger ones (a growing `Vec`, a request actor's
//! boxed state) took the generic aligned path, at several times the instructions of
//! `mi_malloc`. Every mimalloc block is aligned to 8 bytes, so a layout that asks for no
//! more goes to the plain calls, and only wider alignments (tokio's 128-byte task cells and
//! channels) to the aligned ones.
//!
//! [`keep_freed_memory`] stops mimalloc handing freed pages back to the OS during the run.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::{c_int, c_long, c_void};

use libmimalloc_sys as mi;

/// What every mimalloc block is aligned to, whatever its size.
const PLAIN_ALIGN: usize = 8;

pub struct Mimalloc;

// SAFETY: each call forwards to mimalloc with a size and an alignment it honours: the plain
// calls only where the layout's alignment is at most what every block has.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= PLAIN_ALIGN {
            unsafe { mi::mi_malloc(layout.size()) as *mut u8 }
        } else {
            unsafe { mi::mi_malloc_aligned(layout.size(), layout.align()) as *mut u8 }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= PLAIN_ALIGN {
            unsafe { mi::mi_zalloc(layout.size()) as *mut u8 }
        } else {
            unsafe { mi::mi_zalloc_aligned(layout.size(), layout.align()) as *mut u8 }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        unsafe { mi::mi_free(ptr as *mut c_void) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.align() <= PLAIN_ALIGN {
            unsafe { mi::mi_realloc(ptr as *mut c_void, new_size) as *mut u8 }
        } else {
            unsafe {
                mi::mi_realloc_aligned(ptr as *mut c_void, new_size, layout.align()) as *mut u8
            }
        }
    }
}

unsafe extern "C" {
    fn mi_option_get(option: c_int) -> c_long;
    fn mi_option_set(option: c_int, value: c_long);
}

/// `mi_option_purge_delay` in the `mi_option_e` of the mimalloc this build links
/// (libmimalloc-sys 0.1.49, its v3 sources: `include/mimalloc.h`; the default is in
/// `src/options.c`).
const MI_OPTION_PURGE_DELAY: c_int = 15;
/// That option's default there (milliseconds), checked before it is changed: a mimalloc
/// whose options are numbered otherwise is left as it is.
const PURGE_DELAY_DEFAULT_MS: c_long = 1_000;

/// Makes mimalloc keep the pages it frees for the process instead of purging them
/// (returning them to the OS) a second after they empty. The simulation frees and
/// allocates at a steady rate, so a purged page was soon faulted in again, zeroed by the
/// kernel, through the caches: the 1,000,000-request scale step ran about 0.91x as long
/// with its pages kept (same trace hash), at a peak resident set about a tenth larger.
/// Returns whether the option now holds that, or what `MIMALLOC_PURGE_DELAY` asked for.
pub fn keep_freed_memory() -> bool {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return true;
    }
    // SAFETY: plain calls into mimalloc's option table with an index checked by its
    // default value first; a wrong index would change one option, not memory safety.
    unsafe {
        if mi_option_get(MI_OPTION_PURGE_DELAY) != PURGE_DELAY_DEFAULT_MS {
            return false;
        }
        mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        mi_option_get(MI_OPTION_PURGE_DELAY) == -1
    }
}
