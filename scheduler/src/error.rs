//! The one error type of strata-scheduler.

use crate::tier::Tier;

/// Bytes as GiB with two decimals, or MiB under 1 GiB (a few MiB would
/// read as 0.00 GiB).
pub fn gib(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// "at least N more" for a shortfall, or "more room" where the bytes
/// free would cover it but not at once (what else the op holds).
fn more(needed: u64, available: u64) -> String {
    match needed.saturating_sub(available) {
        0 => "more room".into(),
        short => format!("at least {} more", gib(short)),
    }
}

/// Everything that can go wrong while planning or simulating.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SchedulerError {
    /// One op's tensors cannot be on its tier at once, whatever is evicted.
    #[error(
        "op {op} ({op_name}) needs {} on {tier} but only {} of its {} can be made free (the rest \
         holds what this op uses at once); give {tier} {}, lower the micro-batch or the \
         sequence, or place fewer states on {tier}",
        gib(*needed_bytes),
        gib(*available_bytes),
        gib(*capacity_bytes),
        more(*needed_bytes, *available_bytes)
    )]
    DoesNotFit {
        /// Index of the op in the trace.
        op: usize,
        /// Its name.
        op_name: String,
        /// The tier that is too small.
        tier: Tier,
        /// Bytes the op needs there at once.
        needed_bytes: u64,
        /// Bytes that could be freed or were free.
        available_bytes: u64,
        /// The tier's capacity.
        capacity_bytes: u64,
    },
    /// A copy on its way to an op's tier finds no room on a tier between
    /// (a parameter from NVMe staged through the host).
    #[error(
        "op {op} ({op_name}) stages {tensor} ({}) through {tier}, and only {} of {tier}'s {} \
         can be made free; give {tier} {}, or place fewer states on {tier}",
        gib(*needed_bytes),
        gib(*available_bytes),
        gib(*capacity_bytes),
        more(*needed_bytes, *available_bytes)
    )]
    StagingDoesNotFit {
        /// Index of the op in the trace.
        op: usize,
        /// Its name.
        op_name: String,
        /// The tensor being staged.
        tensor: String,
        /// The tier it is staged through.
        tier: Tier,
        /// Its bytes.
        needed_bytes: u64,
        /// Bytes that were free there.
        available_bytes: u64,
        /// The tier's capacity.
        capacity_bytes: u64,
    },
    /// A tier cannot hold what is placed on it before the step starts.
    #[error(
        "the step starts with {} on {tier}, more than the {} the plan may use there; give {tier} \
         at least {} more, or place fewer model states there",
        gib(*placed_bytes),
        gib(*capacity_bytes),
        gib(placed_bytes.saturating_sub(*capacity_bytes))
    )]
    InitialPlacement {
        /// The tier.
        tier: Tier,
        /// Bytes placed there at the start.
        placed_bytes: u64,
        /// Its capacity.
        capacity_bytes: u64,
    },
    /// Even with every block recomputed, the kept inputs fit neither the
    /// device nor the host.
    #[error(
        "the blocks' kept inputs need {needed_bytes} bytes with every block recomputed, but the device has room for {device_room_bytes} and the host for {host_room_bytes} more; give the device or host more memory, or lower the micro-batch, the sequence or the micro-batches per step"
    )]
    ActivationsDoNotFit {
        /// Bytes of every block's input, per micro-batch in flight.
        needed_bytes: u64,
        /// The device's room for them.
        device_room_bytes: u64,
        /// The host's.
        host_room_bytes: u64,
    },
    /// The trace is malformed.
    #[error("invalid trace: {0}")]
    InvalidTrace(String),
    /// A limit (`*_max`) was reached.
    #[error("{what} limit reached: {limit} (raise {what})")]
    Limit {
        /// The limit's name.
        what: &'static str,
        /// Its value.
        limit: u64,
    },
    /// A model, parallelism or hardware description is inconsistent.
    #[error("invalid {what}: {reason}")]
    Config {
        /// What was being described (model, hardware, parallelism).
        what: &'static str,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The simulator could make no progress: the plan leaves an op without
    /// its tensors. Planner plans never do this; a hand-made plan can.
    #[error("simulation stuck at {time_s:.6} s before op {op} ({op_name}): {reason}")]
    Stuck {
        /// Index of the first op that never ran.
        op: usize,
        /// Its name.
        op_name: String,
        /// Simulated time when progress stopped.
        time_s: f64,
        /// Why it cannot run.
        reason: String,
    },
}
