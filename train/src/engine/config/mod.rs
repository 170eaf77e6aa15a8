//! [`TrainConfig`]: what `strata train --config FILE` reads. Every table
//! and field has a default (the built-in small model); unknown keys are
//! rejected by name.
//!
//! One file a concern: `compute.rs` (the compute dtype; `[model]` is the
//! model interface's `ModelConfig`), `train.rs` (`[train]`: batch,
//! optimizer, numerics), `schedule.rs`
//! (`[train.schedule]`), `placement.rs` (`[placement]`, `[optim]`),
//! `validate.rs` (the checks, the closed-form memory count), `device.rs`
//! (the device `auto` resolves to, each rank's runtime tables),
//! `init_from.rs` (`[model]` from a Hugging Face folder's config),
//! `data.rs` (`[data]`: what the run trains on), `resume.rs` (what a
//! resumed run may change).

mod compute;
mod device;
mod init_from;
mod placement;
mod resume;
mod schedule;
mod train;
mod validate;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use strata_storage::{ByteSize, StorageConfig};

use strata_runtime::{DeviceChoice, DeviceConfig, HostConfig, LimitsConfig};
pub use strata_scheduler::{Checkpointing, StateDtype};

use crate::error::bad;
use crate::error::{Result, TrainError};

pub use super::data::{DataAttention, DataConfig, DataFormat, DataPaths};
pub use crate::model::ModelConfig;
pub use compute::ComputeDtype;
pub use init_from::INIT_SEQ_DEFAULT_MAX;
pub use placement::{OptimConfig, Placement, PlacementConfig, StateCache};

pub use resume::{Difference, RUN_CONFIG};
pub use schedule::{COS_MIN_RATIO_DEFAULT, Schedule, WARMUP_NUM_STEPS_DEFAULT, WarmupType};
pub use train::TrainSettings;
pub use validate::Keys;

/// The host buffer size when the config sets no classes.
pub const HOST_BUFFER_BYTES: u64 = 256 << 10;
/// Most data-parallel ranks (threads of one process).
pub const RANKS_MAX: usize = 64;
/// Most micro-batches accumulated into one step.
pub const GRAD_ACCUMULATION_MAX: usize = 1024;
/// The longest wait for an exited run's directory lock, in seconds.
pub const LOCK_WAIT_S_MAX: f64 = 3600.0;
/// The most sequences in one micro-batch.
pub const MICRO_BATCH_MAX: usize = 1 << 16;

/// A training run: the model, the schedule, placements and each rank's
/// runtime (its device, host and NVMe budgets).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// The model.
    pub model: ModelConfig,
    /// Batch, schedule, optimizer.
    pub train: TrainSettings,
    /// Where model states live.
    pub placement: PlacementConfig,
    /// The CPU optimizer's threads and state dtype.
    pub optim: OptimConfig,
    /// Each rank's device; its budget holds the compute workspace and the
    /// tensors the plan puts there.
    pub device: DeviceConfig,
    /// Each rank's pinned host pool (without `classes`: all in 256 KiB
    /// buffers).
    pub host: HostConfig,
    /// Each rank's NVMe tier (a subdirectory per rank); absent: none.
    pub nvme: Option<StorageConfig>,
    /// Threads and limits of each rank's runtime.
    pub runtime: LimitsConfig,
    /// How a checkpoint's Hugging Face weights are written.
    pub checkpoint: CheckpointConfig,
    /// What the run trains on.
    pub data: DataConfig,
    /// Held-out data evaluated during training.
    pub eval: EvalConfig,
    /// Collectives between ranks that are processes.
    pub comm: CommConfig,
    /// How the ranks share the model states (hybrid sharding).
    #[serde(skip_serializing_if = "ParallelConfig::is_default")]
    pub parallel: ParallelConfig,
}

/// The `[parallel]` table: hybrid sharding (FSDP2's HSDP, DeepSpeed's
/// hpZ). Parameters and optimizer states are sharded within groups of
/// `shard_degree` neighbouring ranks and replicated across the groups;
/// gradients are reduce-scattered within a group, then summed across the
/// replicas.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelConfig {
    /// Ranks each model state is sharded over: a divisor of the ranks
    /// (`train.ranks`, or a launcher's processes when it is 1); 0 (the
    /// default): all of them.
    pub shard_degree: usize,
}

impl ParallelConfig {
    fn is_default(&self) -> bool {
        *self == ParallelConfig::default()
    }
}

/// The `[comm]` table: how ranks that are processes (under mpirun, srun
/// or torchrun) exchange.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CommConfig {
    /// Seconds a collective waits for its peers before the run stops,
    /// naming the ranks not heard from (a rank that died or hung).
    pub timeout_s: f64,
}

/// The collectives' timeout by default, in seconds.
pub const COMM_TIMEOUT_S_DEFAULT: f64 = 300.0;
/// The longest timeout a config may give, in seconds.
pub const COMM_TIMEOUT_S_MAX: f64 = 86_400.0;

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            timeout_s: COMM_TIMEOUT_S_DEFAULT,
        }
    }
}

/// The `[eval]` table: the loss over held-out data every `every` steps
/// (and at the run's last), reported with the step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Steps between evaluations; 0 (the default): none.
    pub every: u64,
    /// The held-out files, read as `[data]` reads its own (format,
    /// tokenizer, token dtype, attention); `data` is another name for it.
    #[serde(skip_serializing_if = "DataPaths::is_empty", alias = "data")]
    pub path: DataPaths,
    /// Windows of `seq + 1` tokens each evaluation reads (the first ones,
    /// in file order: the same every time).
    pub windows: u64,
}

/// Windows an evaluation reads by default.
pub const EVAL_WINDOWS_DEFAULT: u64 = 64;

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            every: 0,
            path: DataPaths::default(),
            windows: EVAL_WINDOWS_DEFAULT,
        }
    }
}

impl EvalConfig {
    /// Whether step `step` of a run stopping at `last` evaluates.
    pub fn due(&self, step: u64, last: u64) -> bool {
        self.every > 0 && (step.is_multiple_of(self.every) || step == last)
    }

    /// The `[data]` table its files are read with: `data`'s, on its paths.
    pub fn data(&self, data: &DataConfig) -> DataConfig {
        DataConfig {
            path: self.path.clone(),
            ..data.clone()
        }
    }
}

/// The `[checkpoint]` table: how each step directory's Hugging Face
/// weights are written (where and how often: `train.checkpoint_dir`,
/// `train.checkpoint_every`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// The weights' dtype: "bf16" (default), or "f32" for the master
    /// weights exactly.
    pub weights_dtype: crate::hf::WeightsDtype,
    /// The largest safetensors file; more weights are sharded with an
    /// index (transformers' `max_shard_size`).
    pub max_shard_size: ByteSize,
}

/// The most bytes of weights one safetensors shard holds by default.
pub const MAX_SHARD_SIZE_DEFAULT: u64 = 5 << 30;

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            weights_dtype: crate::hf::WeightsDtype::Bf16,
            max_shard_size: ByteSize(MAX_SHARD_SIZE_DEFAULT),
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: ModelConfig::default(),
            train: TrainSettings::default(),
            placement: PlacementConfig::default(),
            optim: OptimConfig::default(),
            device: DeviceConfig {
                kind: DeviceChoice::Cpu,
                ordinal: 0,
                budget: ByteSize(24 << 20),
            },
            host: HostConfig {
                budget: ByteSize(32 << 20),
                classes: Vec::new(),
                require_locked: false,
            },
            nvme: Some(StorageConfig {
                dirs: vec![PathBuf::from("strata-train-swap")],
                capacity: ByteSize(256 << 20),
                // The built-in default's own directory; one a config names
                // must exist.
                create_dirs: true,
                ..StorageConfig::default()
            }),
            runtime: LimitsConfig::default(),
            checkpoint: CheckpointConfig::default(),
            data: DataConfig::default(),
            eval: EvalConfig::default(),
            comm: CommConfig::default(),
            parallel: ParallelConfig::default(),
        }
    }
}

/// An optimizer or loss-scaler hyperparameter refused by strata-optim,
/// under the `[train]` key it comes from (`value`: what to show when the
/// error names none of them).
pub(super) fn named(err: strata_optim::OptimError, value: impl ToString) -> TrainError {
    match err {
        strata_optim::OptimError::InvalidHyperparameter {
            name,
            value,
            expected,
        } => {
            let key = match name {
                "lr" => "train.lr",
                "beta1" => "train.beta1",
                "beta2" => "train.beta2",
                "eps" => "train.eps",
                "weight_decay" => "train.weight_decay",
                "init_scale" => "train.loss_scale",
                "min_scale" => "train.loss_scale_min",
                "growth_interval" => "train.loss_scale_growth_interval",
                "hysteresis" => "train.loss_scale_hysteresis",
                _ => "train",
            };
            // The key's own name (loss_scale, not the scaler's init_scale).
            let shown = key.strip_prefix("train.").unwrap_or(name);
            // Tiny and huge values in exponent form (1.4e-45, not 45 zeros).
            let value = match value.abs() {
                x if x != 0.0 && !(1e-4..1e9).contains(&x) => format!("{value:e}"),
                _ => value.to_string(),
            };
            bad(key, value, format!("{shown} must be {expected}"))
        }
        other => bad("train", value.to_string(), other.to_string()),
    }
}

/// " at line N (`the line`, in [section])" for the byte `at` of a TOML
/// text: the key a parse error is about, which serde's message leaves out.
fn where_in(text: &str, at: usize) -> String {
    let at = at.min(text.len());
    let line = text[..at].matches('\n').count() + 1;
    let shown = text.lines().nth(line - 1).unwrap_or("").trim();
    let section = text[..at]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('[') && !shown.starts_with('['));
    let shown: String = shown.chars().take(80).collect();
    match section {
        Some(section) => format!(" at line {line} (`{shown}`, in {section})"),
        None if !shown.is_empty() => format!(" at line {line} (`{shown}`)"),
        None => format!(" at line {line}"),
    }
}

impl TrainConfig {
    /// Ranks each model state is sharded over (`parallel.shard_degree`,
    /// or every rank).
    pub fn shards(&self) -> usize {
        match self.parallel.shard_degree {
            0 => self.train.ranks,
            k => k.min(self.train.ranks),
        }
    }

    /// Parses a TOML config; unknown keys and bad values are named.
    pub fn from_toml(text: &str) -> Result<TrainConfig> {
        let config: TrainConfig = toml::from_str(text).map_err(|err| TrainError::Config {
            key: "config",
            value: err.message().to_string(),
            fix: format!(
                "fix the file{}",
                err.span()
                    .map(|span| where_in(text, span.start))
                    .unwrap_or_default()
            ),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// The seed of the bf16 states' stochastic rounding: `optim.rounding_seed`,
    /// or `train.seed` without it.
    pub fn rounding_seed(&self) -> u64 {
        self.optim.rounding_seed.unwrap_or(self.train.seed)
    }

    /// The config as a TOML file that [`TrainConfig::from_toml`] reads back
    /// to the same config (what `strata train --print-config` shows).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self)
            .map_err(|err| bad("config", err, "report this: every config field serializes"))
    }

    /// Whether a placement puts model states on NVMe: the NVMe tier is
    /// opened (its directories locked, its swap files made) only then.
    pub fn uses_nvme(&self) -> bool {
        [self.placement.params, self.placement.optimizer].contains(&Placement::Nvme)
    }
}
