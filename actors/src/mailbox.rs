//! A request actor's mailbox, and the root's: an unbounded queue with one reader, many
//! writers.
//!
//! A request actor reads about six messages in its life, so what a channel costs to make
//! matters more than what a message costs to pass. Tokio's unbounded channel allocated a
//! 128-byte-aligned channel and a first block of 32 slots on creation (5.7 KiB for a
//! request's message), two allocations per request on each side that the scale run's
//! profile showed among the largest it made. This one is a queue under a lock beside the
//! reader's waker, in one allocation of under 100 bytes; the queue grows on first use to
//! four messages.
//!
//! Semantics are those of the channel it replaces, as the request actor relies on them:
//! messages arrive in the order sent; a send to a mailbox whose reader is gone gives the
//! message back; dropping the reader drops what is queued (a consignment in it gives its
//! blocks back to the engine), outside the lock; the reader sees the end (`None`) once every
//! writer is gone and the queue is empty. Unlike tokio's channel, a receive does not count
//! against tokio's cooperative budget: the root feeds an actor, and an actor handles each
//! message to its end before it reads the next; the root, whose mailbox may always hold
//! mail, counts each message itself (`tokio::task::consume_budget`).
//!
//! The root's mailbox was tokio's channel too: it is made once, but every message wrote a
//! slot of a 32-slot block and touched the channel's counters and its waker's. Over 1,000
//! simulated workers, each root's lines are cold by its next message; this queue's
//! buffer is as long as the longest backlog and reused. The simulator's
//! 100,000-request step over 1,000 workers ran 0.92x as long (0.82-0.98, eight paired
//! runs, same trace hash).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

struct Inner<T> {
    queue: VecDeque<T>,
    /// The reader's waker, while it waits for a message.
    waker: Option<Waker>,
    /// Writers alive; at zero, with the queue empty, the reader sees the end.
    senders: usize,
    /// The reader is gone: sends give their message back.
    closed: bool,
}

struct Shared<T>(Mutex<Inner<T>>);

impl<T> Shared<T> {
    /// The state; a panic elsewhere while it was held leaves it whole (every change under
    /// the lock is a single step), so a poisoned lock is taken as it is.
    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A writer's end; cloning adds a writer.
pub(crate) struct Sender<T>(Arc<Shared<T>>);

/// The reader's end (one per mailbox).
pub(crate) struct Receiver<T>(Arc<Shared<T>>);

/// A new mailbox and its first writer.
pub(crate) fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared(Mutex::new(Inner {
        queue: VecDeque::new(),
        waker: None,
        senders: 1,
        closed: false,
    })));
    (Sender(shared.clone()), Receiver(shared))
}

impl<T> Sender<T> {
    /// Queues `msg`, or gives it back if the reader is gone.
    pub(crate) fn send(&self, msg: T) -> Result<(), T> {
        let mut inner = self.0.lock();
        if inner.closed {
            return Err(msg);
        }
        inner.queue.push_back(msg);
        let waker = inner.waker.take();
        drop(inner);
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }
}

impl<T> Sender<T> {
    /// The reader is gone: every send gives its message back.
    pub(crate) fn is_closed(&self) -> bool {
        self.0.lock().closed
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.0.lock().senders += 1;
        Sender(self.0.clone())
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let mut inner = self.0.lock();
        inner.senders -= 1;
        let waker = if inner.senders == 0 {
            inner.waker.take()
        } else {
            None
        };
        drop(inner);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> Receiver<T> {
    /// The next message; `None` once every writer is gone and nothing is queued. Safe to
    /// cancel: a message is taken only when it is returned.
    pub(crate) async fn recv(&mut self) -> Option<T> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut inner = self.0.lock();
        if let Some(msg) = inner.queue.pop_front() {
            return Poll::Ready(Some(msg));
        }
        if inner.senders == 0 {
            return Poll::Ready(None);
        }
        let replaced = match &inner.waker {
            Some(waker) if waker.will_wake(cx.waker()) => None,
            _ => inner.waker.replace(cx.waker().clone()),
        };
        // A waker's drop may run a task's teardown, which may drop a writer of this
        // mailbox: never under its lock.
        drop(inner);
        drop(replaced);
        Poll::Pending
    }
}

impl<T> Drop for Receiver<T> {
    /// Closes the mailbox; what was queued is dropped here, after the lock is let go (a
    /// message's drop may do work of its own).
    fn drop(&mut self) {
        let mut inner = self.0.lock();
        inner.closed = true;
        let queued = std::mem::take(&mut inner.queue);
        let waker = inner.waker.take();
        drop(inner);
        drop(waker);
        drop(queued);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    /// Counts its wake-ups.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn poll<T>(rx: &mut Receiver<T>, waker: &Waker) -> Poll<Option<T>> {
        rx.poll_recv(&mut Context::from_waker(waker))
    }

    /// Counts its drops, to see a message dropped (or not).
    struct Dropped(Arc<AtomicUsize>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn messages_arrive_in_the_order_sent_and_a_waiting_reader_is_woken_once_a_send() {
        let (tx, mut rx) = channel();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        assert!(poll(&mut rx, &waker).is_pending());
        tx.send(1).unwrap();
        tx.send(2).unwrap();
        // Woken by the first send; the second found no waker registered.
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert_eq!(poll(&mut rx, &waker), Poll::Ready(Some(1)));
        assert_eq!(poll(&mut rx, &waker), Poll::Ready(Some(2)));
        assert!(poll(&mut rx, &waker).is_pending());
        tx.send(3).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
        assert_eq!(poll(&mut rx, &waker), Poll::Ready(Some(3)));
    }

    #[test]
    fn the_reader_sees_the_end_only_when_every_writer_is_gone_and_the_queue_is_empty() {
        let (tx, mut rx) = channel();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let other = tx.clone();
        other.send(7).unwrap();
        drop(tx);
        assert_eq!(poll(&mut rx, &waker), Poll::Ready(Some(7)));
        assert!(poll(&mut rx, &waker).is_pending(), "one writer is left");
        drop(other);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "the last writer wakes the reader"
        );
        assert_eq!(poll(&mut rx, &waker), Poll::Ready(None));
    }

    #[test]
    fn a_gone_reader_gives_sends_back_and_drops_what_was_queued() {
        let drops = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = channel();
        tx.send(Dropped(drops.clone()))
            .unwrap_or_else(|_| panic!("open"));
        tx.send(Dropped(drops.clone()))
            .unwrap_or_else(|_| panic!("open"));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(rx);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            2,
            "the queue went with the reader"
        );
        let back = tx.send(Dropped(drops.clone()));
        assert!(
            back.is_err(),
            "a send after the reader is gone gives it back"
        );
        drop(back);
        assert_eq!(drops.load(Ordering::SeqCst), 3);
    }

    /// A message whose drop writes to the mailbox it sits in (as a consignment's drop
    /// reaches back into the runtime).
    struct WritesBack(Option<Sender<WritesBack>>, Arc<AtomicUsize>);

    impl Drop for WritesBack {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let back = tx.send(WritesBack(None, self.1.clone()));
                self.1
                    .fetch_add(usize::from(back.is_err()), Ordering::SeqCst);
            }
        }
    }

    #[test]
    fn a_message_dropped_with_the_reader_may_write_to_its_own_mailbox() {
        let refused = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = channel();
        let msg = WritesBack(Some(tx.clone()), refused.clone());
        assert!(tx.send(msg).is_ok());
        // Only the message holds a writer now: a failing test unwinds without the lock.
        drop(tx);
        // Under the lock, this drop would deadlock on the send inside it: it runs on a
        // thread of its own, waited for with a deadline.
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(rx);
            let _ = done.send(());
        });
        let waited = finished.recv_timeout(std::time::Duration::from_secs(10));
        assert!(waited.is_ok(), "dropping the reader deadlocked");
        assert_eq!(
            refused.load(Ordering::SeqCst),
            1,
            "the closed mailbox refused it"
        );
    }

    #[tokio::test]
    async fn a_reader_on_another_task_gets_every_message_from_writers_on_others() {
        let (tx, mut rx) = channel();
        let writers: Vec<_> = (0..4u64)
            .map(|w| {
                let tx = tx.clone();
                tokio::spawn(async move {
                    for i in 0..100 {
                        tx.send(w * 1000 + i).unwrap();
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        drop(tx);
        let reader = tokio::spawn(async move {
            let mut seen = Vec::new();
            while let Some(v) = rx.recv().await {
                seen.push(v);
            }
            seen
        });
        for w in writers {
            w.await.unwrap();
        }
        let seen = reader.await.unwrap();
        assert_eq!(seen.len(), 400);
        for w in 0..4u64 {
            let mine: Vec<_> = seen.iter().filter(|v| *v / 1000 == w).collect();
            assert!(
                mine.windows(2).all(|p| p[0] < p[1]),
                "each writer's order kept"
            );
        }
    }
}
