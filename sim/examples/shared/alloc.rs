//! The examples' allocator: mimalloc, asked for alignment only when a layout needs more
//! than every mimalloc block has.
//!
//! `mimalloc::MiMalloc` sends every allocation through `mi_malloc_aligned`, whose fast path
//! covers only blocks of at most 1 KiB; larger ones (a growing `Vec`, a request actor's
//! boxed state) took the generic aligned path, at several times the instructions of
//! `mi_malloc`. Every mimalloc block is aligned to 8 bytes, so a layout that asks for no
//! more goes to the plain calls, and only wider alignments (tokio's 128-byte task cells and
//! channels) to the aligned ones.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

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
