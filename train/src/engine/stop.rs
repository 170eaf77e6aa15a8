//! Stopping a run early and cleanly: a [`StopRequest`] is set from outside
//! the ranks (the CLI's signal thread, an embedding program), and every
//! rank sees it at the same step boundary (the ranks agree on it through
//! the collective, so none waits in a collective for a peer that stopped).
//! The run then writes a final checkpoint when it has a checkpoint
//! directory, drops its tiers (removing its swap files) and returns a
//! summary that says why it stopped.
//!
//! A request can also abort the step in progress ([`StopRequest::abort`]:
//! a second signal, or a grace period running out). Every wait of the run
//! on another party (a move, a tensor in use, room on a tier, a peer rank,
//! an optimizer update) checks a [`Cancel`] token the run registered
//! here, so the ranks return within a bounded time
//! ([`Cancel::POLL`] plus the compute op or I/O request in progress) with
//! [`crate::TrainError::Aborted`]; nothing is published mid-step, so the
//! last whole checkpoint stays.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};

use strata_device::Cancel;

/// A request to stop at the next step boundary (or, aborted, at once),
/// shared between whoever asks and the run. Cloning shares it.
#[derive(Clone, Debug, Default)]
pub struct StopRequest(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    code: AtomicI32,
    /// The code of the abort, 0 until one.
    aborted: AtomicI32,
    /// The tokens of the run's runtimes and collective group.
    watched: Mutex<Vec<Cancel>>,
}

impl StopRequest {
    /// A request not yet made.
    pub fn new() -> StopRequest {
        StopRequest::default()
    }

    /// Asks the run to stop at its next step boundary; `signal` is the
    /// signal number that asked (or any positive code of the caller's).
    /// The first request wins.
    pub fn request(&self, signal: i32) {
        assert!(signal > 0, "a stop request carries a positive code");
        let _ = self
            .0
            .code
            .compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// The code of the request, if one was made.
    pub fn requested(&self) -> Option<i32> {
        match self.0.code.load(Ordering::SeqCst) {
            0 => None,
            code => Some(code),
        }
    }

    /// Stops the run at once, mid-step: requests a stop (with `signal`
    /// unless one was requested already) and cancels every token the run
    /// registered, and every one it registers later. The first abort's
    /// `signal` is the one [`crate::TrainError::Aborted`] reports.
    pub fn abort(&self, signal: i32) {
        self.request(signal);
        let watched = self.0.watched.lock().expect("stop tokens");
        let _ = self
            .0
            .aborted
            .compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
        for token in watched.iter() {
            token.cancel();
        }
    }

    /// The code of the abort, if [`StopRequest::abort`] was called.
    pub fn aborted(&self) -> Option<i32> {
        match self.0.aborted.load(Ordering::SeqCst) {
            0 => None,
            code => Some(code),
        }
    }

    /// Registers a token that [`StopRequest::abort`] cancels (at once if
    /// the request is already aborted).
    pub fn watch(&self, token: Cancel) {
        let mut watched = self.0.watched.lock().expect("stop tokens");
        // Checked under the lock, so an abort in between cancels it.
        if self.aborted().is_some() {
            token.cancel();
        }
        // Tokens of runs that ended are let go; a token watched already
        // (the ranks of one in-process group share theirs) is kept once.
        watched.retain(|t| t.holders() > 1);
        if !watched.iter().any(|t| t.same(&token)) {
            watched.push(token);
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_request_wins_and_clones_share_it() {
        let stop = StopRequest::new();
        let seen = stop.clone();
        assert_eq!(seen.requested(), None);
        stop.request(15);
        stop.request(2);
        assert_eq!(seen.requested(), Some(15));
        assert_eq!(seen.aborted(), None);
    }

    #[test]
    fn an_abort_cancels_tokens_watched_before_and_after_it() {
        let stop = StopRequest::new();
        let (before, after) = (Cancel::new(), Cancel::new());
        stop.watch(before.clone());
        stop.request(15);
        assert!(!before.is_cancelled(), "a plain request cancels nothing");
        stop.abort(2);
        stop.abort(9);
        assert!(before.is_cancelled());
        assert_eq!((stop.requested(), stop.aborted()), (Some(15), Some(2)));
        stop.watch(after.clone());
        assert!(after.is_cancelled(), "a late watcher is cancelled at once");
    }

    /// The ranks of an in-process group each register the group's one
    /// token: it is kept once, and let go once the run's clones are gone
    /// (a request reused across runs does not grow by a token per rank).
    #[test]
    fn a_token_watched_again_is_kept_once_and_let_go_with_its_run() {
        let stop = StopRequest::new();
        let group = Cancel::new();
        for _ in 0..4 {
            stop.watch(group.clone());
        }
        assert_eq!(group.holders(), 2, "the group's and one watched clone");
        drop(group);
        let next = Cancel::new();
        stop.watch(next.clone());
        assert_eq!(next.holders(), 2);
        stop.abort(1);
        assert!(next.is_cancelled());
    }
}
