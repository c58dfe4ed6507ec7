//! Which processes of a peer's rank may still write into our blocks, as plain data.
//!
//! A quarantine ([`handoff_actors::link::Link::writer_exit`]) holds blocks until the lost
//! writer's process has exited. That is the process that held the rank when the request
//! lost it, not whichever process holds the rank now: a restarted worker takes its old
//! rank while the old process may still be stopped between the check of its lease and a
//! post. Each connection to a rank replaces what we know of its data plane, so the
//! processes verified for its earlier connections are kept here while they live.
//!
//! Incarnations grow with every start of a worker process (`new_incarnation`), so "older
//! than" is "started before".

/// Earlier processes kept per rank, at most. A rank restarted this many times while its
/// old processes all live on (stopped, say) loses the oldest: it is then watched no more,
/// and a quarantine waiting for it ends on what the rest say.
pub const EARLIER_WRITERS_MAX: usize = 8;

/// One rank's processes from before its current connection (`P`: a verified process in
/// the transport, anything in tests).
#[derive(Clone, Debug)]
pub(crate) struct WriterHistory<P> {
    /// Processes of earlier connections not yet seen to exit, by incarnation, oldest first.
    earlier: Vec<(u64, P)>,
}

impl<P> Default for WriterHistory<P> {
    fn default() -> Self {
        Self {
            earlier: Vec::new(),
        }
    }
}

impl<P: Clone> WriterHistory<P> {
    /// A new connection replaces the one of incarnation `was`, whose verified process was
    /// `process`: it is kept while it lives (`alive`), as are the earlier ones. Returns a
    /// process dropped because more than [`EARLIER_WRITERS_MAX`] live on.
    pub(crate) fn superseded(
        &mut self,
        was: u64,
        process: Option<P>,
        alive: impl Fn(&P) -> bool,
    ) -> Option<(u64, P)> {
        self.earlier.retain(|(_, p)| alive(p));
        if let Some(p) = process {
            self.earlier.push((was, p));
        }
        (self.earlier.len() > EARLIER_WRITERS_MAX).then(|| self.earlier.remove(0))
    }

    /// The processes a quarantine of this rank watches, when the rank now has incarnation
    /// `current`, verified as `process` if it was. `replaced`: a newer process took the
    /// rank since the request lost its writer, so the writer is one of the earlier
    /// incarnations' processes (all of them: which one held the grant is not known here).
    /// Otherwise the writer is the current incarnation's process (on this connection, or
    /// on an earlier one of the same incarnation). Empty when none of them was verified
    /// (nothing can be watched).
    pub(crate) fn watch(&self, current: u64, process: Option<&P>, replaced: bool) -> Vec<P> {
        let mut watched: Vec<P> = self
            .earlier
            .iter()
            .filter(|(inc, _)| {
                if replaced {
                    *inc < current
                } else {
                    *inc == current
                }
            })
            .map(|(_, p)| p.clone())
            .collect();
        if !replaced {
            watched.extend(process.cloned());
        }
        watched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn always(_: &&'static str) -> bool {
        true
    }

    #[test]
    fn a_writer_not_replaced_is_its_ranks_current_process() {
        let h = WriterHistory::default();
        assert_eq!(h.watch(1, Some(&"p1"), false), vec!["p1"]);
        // Not verified: nothing to watch (the bound decides).
        assert!(h.watch(1, None, false).is_empty());
    }

    #[test]
    fn a_replaced_writer_is_an_earlier_process_never_the_new_one() {
        let mut h = WriterHistory::default();
        assert_eq!(h.superseded(1, Some("p1"), always), None);
        assert_eq!(h.watch(2, Some(&"p2"), true), vec!["p1"]);
        // A request the new process held: it alone.
        assert_eq!(h.watch(2, Some(&"p2"), false), vec!["p2"]);
        // The old one was never verified: nothing to watch for a replaced writer.
        let mut unverified = WriterHistory::default();
        unverified.superseded(1, None, always);
        assert!(unverified.watch(2, Some(&"p2"), true).is_empty());
    }

    #[test]
    fn a_reconnect_of_the_same_process_keeps_it_watched() {
        let mut h = WriterHistory::default();
        h.superseded(1, Some("p1"), always);
        // The same incarnation back on a new connection, not verified again yet.
        assert_eq!(h.watch(1, None, false), vec!["p1"]);
        assert!(h.watch(1, None, true).is_empty());
    }

    #[test]
    fn exited_processes_are_forgotten_and_the_history_is_bounded() {
        let mut h = WriterHistory::default();
        h.superseded(1, Some("gone"), always);
        h.superseded(2, Some("p2"), |p| *p != "gone");
        assert_eq!(h.watch(3, None, true), vec!["p2"]);
        let mut dropped = Vec::new();
        for inc in 3..(3 + EARLIER_WRITERS_MAX as u64) {
            dropped.extend(h.superseded(inc, Some("p"), always));
        }
        assert_eq!(dropped, vec![(2, "p2")]);
        assert_eq!(h.earlier.len(), EARLIER_WRITERS_MAX);
    }
}
