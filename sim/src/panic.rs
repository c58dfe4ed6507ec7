//! Panics, recorded per simulation thread.
//!
//! A request actor catches a panic in its handler and tells the root (`ChildGone`), so a
//! panic that the runtime survives would go unseen. A process-wide hook (installed once)
//! records every panic on a thread that is running a simulation; the simulation then
//! separates the ones it injected (`inject_panic`) from the rest, which break "no crash".
//! Panics on other threads go to the previous hook as before.

use std::cell::RefCell;
use std::sync::Once;

/// What the runtime's injected panic says (`RequestMsg::Panic` in the actors crate).
pub const INJECTED_PANIC_TEXT: &str = "injected fault in request";

thread_local! {
    static CAPTURED: RefCell<Option<Vec<String>>> = const { RefCell::new(None) };
}

static INSTALL: Once = Once::new();

fn install() {
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let text = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with a non-text payload".into());
            let at = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            let recorded = CAPTURED
                .try_with(|c| match c.borrow_mut().as_mut() {
                    Some(v) => {
                        v.push(format!("{text}{at}"));
                        true
                    }
                    None => false,
                })
                .unwrap_or(false);
            if !recorded {
                previous(info);
            }
        }));
    });
}

/// Records the panics of this thread until dropped.
pub struct Capture(());

impl Capture {
    /// Starts recording this thread's panics.
    pub fn start() -> Self {
        install();
        CAPTURED.with(|c| *c.borrow_mut() = Some(Vec::new()));
        Self(())
    }

    /// The panics recorded so far (and clears them).
    pub fn take(&self) -> Vec<String> {
        CAPTURED.with(|c| {
            c.borrow_mut()
                .as_mut()
                .map(std::mem::take)
                .unwrap_or_default()
        })
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = CAPTURED.try_with(|c| *c.borrow_mut() = None);
    }
}
