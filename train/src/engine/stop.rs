//! Stopping a run early and cleanly: a [`StopRequest`] is set from outside
//! the ranks (the CLI's signal thread, an embedding program), and every
//! rank sees it at the same step boundary (the ranks agree on it through
//! the collective, so none waits in a collective for a peer that stopped).
//! The run then writes a final checkpoint when it has a checkpoint
//! directory, drops its tiers (removing its swap files) and returns a
//! summary that says why it stopped.

use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};

/// A request to stop at the next step boundary, shared between whoever
/// asks and the run. Cloning shares it.
#[derive(Clone, Debug, Default)]
pub struct StopRequest(Arc<AtomicI32>);

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
            .compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// The code of the request, if one was made.
    pub fn requested(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            code => Some(code),
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
    }
}
