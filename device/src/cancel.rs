//! Cancelling blocked waits: a [`Cancel`] token shared between whoever
//! aborts (a second signal, a grace period running out, an embedding
//! program) and every wait that may block on another party (a queued
//! move, a tensor someone holds, room on a tier, a peer rank).
//!
//! Such waits sleep on their condition variable for at most
//! [`Cancel::POLL`] at a time and check the token in between, so they see
//! a cancellation within that bound without the aborting side knowing
//! every condition variable. Waits on work already running (a compute op,
//! an I/O request in the kernel, a copy on a stream) are bounded by that
//! work and are not cut short: their buffers are in use until it ends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, MutexGuard};
use std::time::Duration;

/// A cancellation shared by clones: once [`Cancel::cancel`] is called,
/// [`Cancel::is_cancelled`] holds for every clone, for good.
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// The longest a cancellable wait sleeps before checking its token.
    pub const POLL: Duration = Duration::from_millis(10);

    /// A token not yet cancelled.
    pub fn new() -> Cancel {
        Cancel::default()
    }

    /// Cancels every wait that checks this token (or a clone of it).
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether [`Cancel::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Whether `other` is a clone of this token (cancelling one cancels
    /// the other).
    pub fn same(&self, other: &Cancel) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// How many clones of this token exist (this one included): a
    /// registry holding the only one may let it go.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// Sleeps on `changed` for at most [`Cancel::POLL`]; the caller
    /// re-checks its condition and this token after each return.
    pub fn sleep<'a, T>(changed: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        // A poisoned lock means a thread panicked holding it: a bug.
        changed
            .wait_timeout(guard, Self::POLL)
            .expect("a cancellable wait's lock")
            .0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Instant;

    #[test]
    fn clones_share_the_cancellation_and_a_sleeper_sees_it_within_the_poll() {
        let cancel = Cancel::new();
        let seen = cancel.clone();
        assert!(!seen.is_cancelled());
        let lock = Mutex::new(());
        let changed = Condvar::new();
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                let mut guard = lock.lock().unwrap();
                while !seen.is_cancelled() {
                    guard = Cancel::sleep(&changed, guard);
                }
                Instant::now()
            });
            std::thread::sleep(Duration::from_millis(30));
            // No notify: the poll alone must wake the waiter.
            let cancelled_at = Instant::now();
            cancel.cancel();
            // Woken within a bound of the cancellation (measured from it: a
            // busy machine may start the waiter late).
            let woke_at = waiter.join().unwrap();
            let late = woke_at.saturating_duration_since(cancelled_at);
            assert!(late < Duration::from_secs(2), "{late:?}");
        });
    }
}
