//! The one error type of strata-train.

use std::path::PathBuf;

use strata_comm::CommError;
use strata_device::DeviceError;
use strata_kernels::KernelError;
use strata_optim::OptimError;
use strata_runtime::RuntimeError;
use strata_scheduler::SchedulerError;
use strata_storage::StorageError;

/// Everything that can go wrong in training. Variants carry the numbers
/// and the field at fault; messages say what to change.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The run was aborted mid-step ([`crate::StopRequest::abort`]: a
    /// second signal, or `--signal-grace` running out).
    #[error(
        "aborted mid-step (stop code {code}): the step in progress was dropped unpublished; the last whole checkpoint stays"
    )]
    Aborted {
        /// The stop request's code (the signal).
        code: i32,
    },
    /// A configuration value is out of range or inconsistent.
    #[error("invalid setting {key} = {value}: {fix}")]
    Config {
        /// The field (dotted TOML path).
        key: &'static str,
        /// The value given.
        value: String,
        /// What to change.
        fix: String,
    },
    /// A DeepSpeed config (`strata train --deepspeed`) sets a key to a
    /// value strata cannot honor, or one DeepSpeed itself would refuse.
    #[error("DeepSpeed config: {key} = {value}: {fix}")]
    DeepSpeed {
        /// The key, dotted (`zero_optimization.offload_optimizer.ratio`).
        key: String,
        /// The value given, as JSON.
        value: String,
        /// What to change.
        fix: String,
    },
    /// The training step's plan cannot place the model states, activations
    /// and working tensors in the tier budgets.
    #[error("the placement does not fit: {cause}")]
    DoesNotFit {
        /// The planner's finding, with its numbers (in the message, so
        /// not also a source: it would print twice).
        cause: SchedulerError,
    },
    /// The model and batch cannot fit a tier's budget: a closed-form
    /// count made before any planning or allocation.
    #[error(
        "the model does not fit: the {tier} tier needs at least {} ({what}), and {budget_key} is {} ({detail}); {fix}",
        strata_scheduler::gib(*needed_bytes),
        strata_scheduler::gib(*budget_bytes)
    )]
    Memory {
        /// What needs the room.
        what: String,
        /// The tier.
        tier: &'static str,
        /// Bytes needed at the least.
        needed_bytes: u64,
        /// The setting that bounds the tier.
        budget_key: &'static str,
        /// Its value.
        budget_bytes: u64,
        /// How the bytes add up.
        detail: String,
        /// What to change.
        fix: String,
    },
    /// Planning failed for another reason (a limit, a malformed trace).
    #[error(transparent)]
    Scheduler(SchedulerError),
    /// Reading or writing a checkpoint failed.
    #[error("checkpoint {path}: {problem}; {fix}")]
    Checkpoint {
        /// The file or directory.
        path: PathBuf,
        /// What went wrong.
        problem: String,
        /// What to do.
        fix: String,
    },
    /// A Hugging Face folder (`config.json`, safetensors shards) cannot be
    /// read as the model it names.
    #[error("Hugging Face folder {path}: {problem}; {fix}")]
    HfFolder {
        /// The file or directory.
        path: PathBuf,
        /// What went wrong.
        problem: String,
        /// What to do.
        fix: String,
    },
    /// The data a run trains on cannot be read as `[data]` says, or is not
    /// the data a resumed checkpoint was trained on.
    #[error("data {path}: {problem}; {fix}")]
    Data {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong, with its position.
        problem: String,
        /// What to do.
        fix: String,
    },
    /// A directory the run would own (checkpoints, swap) is another run's,
    /// or cannot be locked.
    #[error("{what} {dir}: {problem}; {fix}")]
    Ownership {
        /// The setting it came from (`train.checkpoint_dir`, an
        /// `nvme.dirs` entry).
        what: String,
        /// The directory.
        dir: PathBuf,
        /// What stands in the way, with the holder named.
        problem: String,
        /// What to do.
        fix: String,
    },
    /// Another rank of the data-parallel group failed.
    #[error("rank {rank} failed: {cause}")]
    Rank {
        /// The rank.
        rank: usize,
        /// Its error.
        cause: String,
    },
    /// The operating system refused an operation: creating a directory or
    /// a file, starting a thread. Carries the errno and what was tried.
    #[error("{operation} failed: {error}; {fix}")]
    Os {
        /// What was tried, with its path or name ("create nvme.dirs entry
        /// /mnt/swap").
        operation: String,
        /// The raw OS error number (0 when the OS gave none).
        errno: i32,
        /// The error.
        error: std::io::Error,
        /// What to do.
        fix: &'static str,
    },
    /// Gradients overflowed at the smallest loss scale: no scale makes
    /// them finite, the run has diverged.
    #[error(
        "step {step}: the gradients overflowed at the smallest loss scale ({loss_scale}, \
         train.loss_scale_min; the loss was {loss}): the run has diverged and skipping \
         steps cannot bring it back. Lower train.lr (or raise train.warmup_steps, or lower \
         train.clip_norm) and resume from a checkpoint written before it"
    )]
    Diverged {
        /// The step.
        step: u64,
        /// The loss scale it ran at.
        loss_scale: f32,
        /// Its loss (NaN or infinite where the forward pass overflowed).
        loss: f64,
    },
    /// A step failed part way: the engine's state is no step's.
    #[error(
        "step {step} failed part way (its error was reported then), so this engine holds no \
         step's state: make a new engine and resume from the last checkpoint"
    )]
    EngineFailed {
        /// The step that failed.
        step: u64,
    },
    /// The CPU optimizer thread stopped (its own error was reported).
    #[error("the CPU optimizer thread has stopped; no more updates can run")]
    OptimizerStopped,
    /// The runtime (tiers, moves, budgets) failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A collective failed (a rank left, a limit).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A collective of one of hybrid sharding's groups failed.
    #[error("{group} group: {cause}")]
    GroupComm {
        /// The group: "shard" or "replica".
        group: &'static str,
        /// What failed.
        cause: CommError,
    },
    /// A collective of a run's step failed: which step, in which group.
    #[error("step {step}, {group} group: {cause}")]
    StepComm {
        /// The step (from 1) that was running.
        step: u64,
        /// The group the collective was of.
        group: &'static str,
        /// What failed.
        cause: CommError,
    },
    /// The device failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A compute op was refused (a shape, a dtype, a token outside the
    /// vocabulary) or failed on the device.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A model buffer given to a model function has the wrong size.
    #[error("{what} holds {actual} elements but the model's shape needs {expected}")]
    Shape {
        /// Which buffer.
        what: &'static str,
        /// Its elements.
        actual: usize,
        /// What the shape needs.
        expected: usize,
    },
    /// An optimizer kernel's setting is out of range.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// The NVMe tier or a file failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
}

/// Results of strata-train.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

impl From<SchedulerError> for TrainError {
    fn from(cause: SchedulerError) -> Self {
        match cause {
            SchedulerError::DoesNotFit { .. }
            | SchedulerError::StagingDoesNotFit { .. }
            | SchedulerError::InitialPlacement { .. } => TrainError::DoesNotFit { cause },
            other => TrainError::Scheduler(other),
        }
    }
}

impl TrainError {
    /// Whether this is another rank leaving a collective, or not answering
    /// one in time (reported after that rank's own error, where it had
    /// one), or a group given up after that.
    pub fn is_peer_left(&self) -> bool {
        matches!(
            self.comm(),
            Some(
                CommError::PeerLeft { .. }
                    | CommError::Closed { .. }
                    | CommError::Timeout { .. }
                    | CommError::Abandoned { .. }
            )
        )
    }

    /// The collective's error, where this is one.
    fn comm(&self) -> Option<&CommError> {
        match self {
            TrainError::Comm(cause)
            | TrainError::GroupComm { cause, .. }
            | TrainError::StepComm { cause, .. } => Some(cause),
            _ => None,
        }
    }

    /// This error as one of step `step`: a collective's names the step
    /// and its group (the data-parallel group of every rank, or hybrid
    /// sharding's shard or replica group).
    pub(crate) fn in_step(self, step: u64) -> TrainError {
        match self {
            TrainError::Comm(cause) => TrainError::StepComm {
                step,
                group: "data-parallel",
                cause,
            },
            TrainError::GroupComm { group, cause } => TrainError::StepComm { step, group, cause },
            other => other,
        }
    }

    /// A collective's error in hybrid sharding's `group` ("shard" or
    /// "replica"), or of every rank's group without it (`hybrid` false).
    pub(crate) fn of_group(cause: CommError, group: &'static str, hybrid: bool) -> TrainError {
        match hybrid {
            true => TrainError::GroupComm { group, cause },
            false => TrainError::Comm(cause),
        }
    }

    /// Whether this is a wait cancelled by an abort (see
    /// [`crate::StopRequest::abort`]), or a peer leaving because of one.
    pub fn is_cancelled(&self) -> bool {
        matches!(self, TrainError::Runtime(RuntimeError::Cancelled))
            || matches!(self.comm(), Some(CommError::Cancelled))
    }
}

/// An OS failure of `operation`, with its errno and the fix.
pub(crate) fn os(
    operation: impl Into<String>,
    error: std::io::Error,
    fix: &'static str,
) -> TrainError {
    TrainError::Os {
        operation: operation.into(),
        errno: error.raw_os_error().unwrap_or(0),
        error,
        fix,
    }
}

/// A configuration error naming the field, the value and the fix.
pub(crate) fn bad(key: &'static str, value: impl ToString, fix: impl Into<String>) -> TrainError {
    TrainError::Config {
        key,
        value: value.to_string(),
        fix: fix.into(),
    }
}
