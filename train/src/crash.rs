//! The multi-process crash model's injection point. With
//! `STRATA_CRASH_AT=<rank>:<n>` in its environment, the process of that
//! rank (torchrun's `RANK`, as `strata train --nproc` sets it; 0 without
//! it) aborts at its `n`-th checkpoint file operation, counted from 1
//! (creating, writing, syncing, renaming or removing a checkpoint's file or
//! directory): stopped there as a killed process would be, its files as
//! far as they got. `tests/nproc.rs` takes every operation of a rank in
//! turn. Read once; without the variable nothing is counted.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The variable that asks for a crash.
pub const CRASH_AT: &str = "STRATA_CRASH_AT";

static AT: OnceLock<Option<u64>> = OnceLock::new();
static DONE: AtomicU64 = AtomicU64::new(0);

/// The operation this process is to abort at, if any.
fn planned() -> Option<u64> {
    *AT.get_or_init(|| {
        let text = std::env::var(CRASH_AT).ok()?;
        let (rank, at) = text.split_once(':')?;
        let mine = std::env::var("RANK").unwrap_or_else(|_| "0".into());
        (rank.trim() == mine.trim())
            .then(|| at.trim().parse().ok())
            .flatten()
    })
}

/// Counts one checkpoint file operation, and aborts the process at the
/// planned one.
pub(crate) fn point(what: &str) {
    let Some(at) = planned() else { return };
    if DONE.fetch_add(1, Ordering::SeqCst) + 1 == at {
        eprintln!("strata: {CRASH_AT}: aborting at checkpoint operation {at} ({what})");
        std::process::abort();
    }
}
