//! [`TrainConfig`]: what `strata train --config FILE` reads. Every table
//! and field has a default (the built-in small model); unknown keys are
//! rejected by name.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use strata_optim::{AdamConfig, LossScalerConfig};
use strata_storage::{ByteSize, StorageConfig};

use strata_runtime::{DeviceChoice, DeviceConfig, HostConfig, LimitsConfig, RuntimeConfig};
pub use strata_scheduler::{Checkpointing, StateDtype};

use crate::error::bad;
use crate::error::{Result, TrainError};
use crate::model::{Arch, Model};
use strata_runtime::Tier;

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

/// Where a class of model state lives between uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Device memory.
    Device,
    /// Pinned host memory.
    Cpu,
    /// The NVMe swap store.
    Nvme,
}

impl Placement {
    /// The tier.
    pub fn tier(self) -> Tier {
        match self {
            Placement::Device => Tier::Device,
            Placement::Cpu => Tier::Host,
            Placement::Nvme => Tier::Nvme,
        }
    }
}

/// The element type of activations and the matrix products' operands on
/// the device (`[train] compute_dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum ComputeDtype {
    /// bf16 on a GPU (tensor cores), f32 on the CPU device.
    #[default]
    Auto,
    /// f32 everywhere.
    F32,
    /// bf16 activations and matrix operands, fp32 accumulation; parameter
    /// gradients, biases, LayerNorm parameters and statistics stay f32.
    Bf16,
}

impl TryFrom<String> for ComputeDtype {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        match text.as_str() {
            "auto" => Ok(ComputeDtype::Auto),
            "f32" | "fp32" => Ok(ComputeDtype::F32),
            "bf16" => Ok(ComputeDtype::Bf16),
            _ => Err(format!(
                "compute_dtype: {text:?} is not \"auto\", \"f32\" or \"bf16\""
            )),
        }
    }
}

impl ComputeDtype {
    /// The dtype on a device of `kind`.
    pub fn resolve(self, kind: strata_device::DeviceKind) -> strata_device::Dtype {
        use strata_device::{DeviceKind, Dtype};
        match (self, kind) {
            (ComputeDtype::F32, _) | (ComputeDtype::Auto, DeviceKind::Cpu) => Dtype::F32,
            (ComputeDtype::Bf16, _) | (ComputeDtype::Auto, DeviceKind::Cuda) => Dtype::Bf16,
        }
    }
}

/// The `[model]` table: the architecture (a name in
/// [`crate::model::ARCHITECTURES`]) and its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// The architecture (`strata train --print-config` shows the default).
    pub arch: Arch,
    /// Vocabulary (256: byte-level tokens).
    pub vocab: usize,
    /// Sequence length.
    pub seq: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            arch: Arch::default(),
            vocab: 256,
            seq: 64,
            hidden: 128,
            heads: 4,
            layers: 4,
        }
    }
}

impl ModelConfig {
    /// The architecture of this shape ([`crate::model::build`]): its
    /// shape checked, the error naming the key.
    pub fn build(&self) -> Result<Box<dyn Model>> {
        crate::model::build(self)
    }
}

/// The `[train]` table: batch, schedule, optimizer, numerics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSettings {
    /// Steps to run (also the length of the cosine schedule, and of a
    /// DeepSpeed schedule whose `total_num_steps` is unset).
    pub steps: u64,
    /// Sequences per rank per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per step.
    pub grad_accumulation: usize,
    /// Data-parallel ranks (ZeRO-3 shards), as threads of this process.
    pub ranks: usize,
    /// Seeds initialization and data order.
    pub seed: u64,
    /// Which blocks keep only their input between forward and backward and
    /// recompute the rest (activation checkpointing): `true` every block,
    /// `false` none, `"auto"` the blocks the planner picks when not all
    /// activations fit the device (the first ones, where a recompute costs
    /// less than the host round trip).
    pub checkpoint_activations: Checkpointing,
    /// Activations and matrix operands on the device: `"auto"` (bf16 on a
    /// GPU, f32 on the CPU device), `"f32"` or `"bf16"`.
    pub compute_dtype: ComputeDtype,
    /// Peak learning rate (DeepSpeed's `warmup_max_lr`, or the optimizer
    /// lr that `warmup_cosine_lr` scales).
    pub lr: f64,
    /// Steps of linear warmup from 0 to `lr` (`schedule.kind = "cosine"`).
    pub warmup_steps: u64,
    /// Learning rate at the end of the cosine decay (`schedule.kind =
    /// "cosine"`).
    pub lr_min: f64,
    /// The learning-rate schedule (`[train.schedule]`): strata's warmup and
    /// cosine decay, or one of DeepSpeed's schedulers.
    pub schedule: Schedule,
    /// AdamW first-moment decay.
    pub beta1: f64,
    /// AdamW second-moment decay.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Decoupled weight decay of weight matrices and embeddings.
    pub weight_decay: f64,
    /// Clip gradients to this global L2 norm; 0 turns clipping off.
    pub clip_norm: f64,
    /// Loss scaling: the first scale (the only one when
    /// `loss_scale_dynamic` is false).
    pub loss_scale: f32,
    /// Whether the loss scale halves on overflows and doubles after
    /// `loss_scale_growth_interval` clean steps; false: a static scale
    /// (overflowed steps are still skipped).
    pub loss_scale_dynamic: bool,
    /// Clean steps before the loss scale doubles.
    pub loss_scale_growth_interval: u32,
    /// Overflows in a row before the loss scale halves.
    pub loss_scale_hysteresis: u32,
    /// The loss scale never falls below this.
    pub loss_scale_min: f32,
    /// Write a checkpoint every this many steps (0: only at the end when
    /// `checkpoint_dir` is set).
    pub checkpoint_every: u64,
    /// Where checkpoints go; none means no checkpoints.
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoints kept in `checkpoint_dir`, the newest; older ones are
    /// removed once a new one is whole (0: keep every one).
    pub checkpoints_kept: usize,
    /// Seconds to wait for the lock of a run that has exited to be
    /// released (its checkpoint or swap directory): the release can lag
    /// the process's death while a large pinned pool is unpinned.
    pub lock_wait_s: f64,
}

impl Default for TrainSettings {
    fn default() -> Self {
        TrainSettings {
            steps: 300,
            micro_batch: 8,
            grad_accumulation: 1,
            ranks: 1,
            seed: 1,
            checkpoint_activations: Checkpointing::Auto,
            compute_dtype: ComputeDtype::Auto,
            lr: 3e-3,
            warmup_steps: 20,
            lr_min: 3e-4,
            schedule: Schedule::Cosine,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            clip_norm: 1.0,
            loss_scale: 1024.0,
            loss_scale_dynamic: true,
            loss_scale_growth_interval: 200,
            loss_scale_hysteresis: 1,
            loss_scale_min: 1.0,
            checkpoint_every: 0,
            checkpoint_dir: None,
            checkpoints_kept: 0,
            lock_wait_s: 10.0,
        }
    }
}

impl TrainSettings {
    /// Micro-batches in flight at once: all of them, block by block, so
    /// that each block's parameters are fetched once per pass.
    pub(crate) fn in_flight(&self) -> usize {
        self.grad_accumulation
    }

    /// AdamW at `lr`.
    pub fn adam(&self, lr: f64) -> AdamConfig {
        AdamConfig {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            decoupled_weight_decay: true,
            maximize: false,
            bias_correction: true,
        }
    }

    /// The learning rate of step `step` (from 1), as [`Schedule`] defines
    /// it.
    pub fn lr_at(&self, step: u64) -> f64 {
        match self.schedule {
            Schedule::Cosine => self.cosine_lr_at(step),
            Schedule::WarmupLr {
                warmup_min_lr,
                warmup_num_steps,
                warmup_type,
            } => {
                let warmup = Warmup::new(warmup_num_steps, warmup_type);
                match deepspeed_iteration(step) {
                    None => warmup_min_lr,
                    Some(i) => warmup_min_lr + (self.lr - warmup_min_lr) * warmup.gamma(i, 1.0),
                }
            }
            Schedule::WarmupDecayLr {
                warmup_min_lr,
                warmup_num_steps,
                warmup_type,
                total_num_steps,
            } => {
                let warmup = Warmup::new(warmup_num_steps, warmup_type);
                let total = total_num_steps.unwrap_or(self.steps) as f64;
                match deepspeed_iteration(step) {
                    None => warmup_min_lr,
                    Some(i) => {
                        let decay = (total - i as f64) / (total - warmup.steps as f64).max(1.0);
                        let gamma = warmup.gamma(i, decay.max(0.0));
                        warmup_min_lr + (self.lr - warmup_min_lr) * gamma
                    }
                }
            }
            Schedule::WarmupCosineLr { .. } => self.lr * self.cosine_ratio_at(step),
        }
    }

    /// `schedule.kind = "cosine"`: linear warmup, then cosine decay to
    /// `lr_min` at `steps`.
    fn cosine_lr_at(&self, step: u64) -> f64 {
        if step <= self.warmup_steps {
            return self.lr * step as f64 / self.warmup_steps.max(1) as f64;
        }
        let span = self.steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
        self.lr_min
            + 0.5 * (self.lr - self.lr_min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }

    /// DeepSpeed's `WarmupCosineLR.get_lr_ratio`, the factor on `lr`.
    fn cosine_ratio_at(&self, step: u64) -> f64 {
        let Schedule::WarmupCosineLr {
            warmup_min_ratio,
            cos_min_ratio,
            warmup_num_steps,
            warmup_type,
            total_num_steps,
        } = self.schedule
        else {
            return 1.0;
        };
        let warmup = Warmup::new(warmup_num_steps, warmup_type);
        let Some(i) = deepspeed_iteration(step) else {
            return 0.0;
        };
        if i < warmup.steps {
            let ratio = warmup.gamma(i, 1.0);
            return warmup_min_ratio + ratio * (1.0 - warmup_min_ratio);
        }
        let real_last_step = (i - warmup.steps + 1) as f64;
        let total = total_num_steps.unwrap_or(self.steps);
        let real_total_steps = total.saturating_sub(warmup.steps).max(1) as f64;
        let progress = (real_last_step / real_total_steps).min(1.0);
        let ratio = (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
        (cos_min_ratio + (1.0 - cos_min_ratio) * ratio).max(0.0)
    }

    /// The loss scaler's settings.
    pub fn scaler(&self) -> LossScalerConfig {
        if !self.loss_scale_dynamic {
            // A static scale: never grows, and backing off stops at itself.
            return LossScalerConfig {
                init_scale: self.loss_scale,
                growth_factor: 1.0,
                growth_interval: u32::MAX,
                hysteresis: 1,
                min_scale: self.loss_scale,
                ..LossScalerConfig::default()
            };
        }
        LossScalerConfig {
            init_scale: self.loss_scale,
            growth_interval: self.loss_scale_growth_interval,
            hysteresis: self.loss_scale_hysteresis,
            min_scale: self.loss_scale_min,
            ..LossScalerConfig::default()
        }
    }
}

/// The `[train.schedule]` table: how the learning rate moves over the
/// steps. `kind = "cosine"` is strata's own schedule; the others are
/// DeepSpeed's schedulers of the same names, step for step (see
/// [`TrainSettings::lr_at`]): strata's step `s` runs at the learning rate
/// DeepSpeed's scheduler holds after `s - 1` calls of `step()`, since
/// DeepSpeed steps its scheduler after each optimizer step. (DeepSpeed does
/// not step it after a step skipped on overflow; strata's schedule counts
/// every step.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Schedule {
    /// Linear warmup from 0 to `train.lr` over `train.warmup_steps`, then
    /// cosine decay to `train.lr_min` at `train.steps`.
    #[default]
    Cosine,
    /// DeepSpeed's `WarmupLR`: from `warmup_min_lr` to `train.lr` (its
    /// `warmup_max_lr`) over `warmup_num_steps`, then constant.
    WarmupLr {
        /// The learning rate the warmup starts from.
        #[serde(default)]
        warmup_min_lr: f64,
        /// Warmup steps (DeepSpeed uses at least 2).
        #[serde(default = "warmup_num_steps_default")]
        warmup_num_steps: u64,
        /// `log` (DeepSpeed's default) or `linear`.
        #[serde(default)]
        warmup_type: WarmupType,
    },
    /// DeepSpeed's `WarmupDecayLR`: `WarmupLR`'s warmup, then linear decay
    /// to 0 at `total_num_steps`.
    WarmupDecayLr {
        /// The learning rate the warmup starts from.
        #[serde(default)]
        warmup_min_lr: f64,
        /// Warmup steps (DeepSpeed uses at least 2).
        #[serde(default = "warmup_num_steps_default")]
        warmup_num_steps: u64,
        /// `log` (DeepSpeed's default) or `linear`.
        #[serde(default)]
        warmup_type: WarmupType,
        /// Where the decay reaches 0; unset: `train.steps`.
        total_num_steps: Option<u64>,
    },
    /// DeepSpeed's `WarmupCosineLR`: `train.lr` times a ratio that warms up
    /// from `warmup_min_ratio` to 1 over `warmup_num_steps`, then follows a
    /// cosine to `cos_min_ratio` at `total_num_steps`.
    WarmupCosineLr {
        /// The ratio the warmup starts from.
        #[serde(default)]
        warmup_min_ratio: f64,
        /// The ratio at the end of the cosine.
        #[serde(default = "cos_min_ratio_default")]
        cos_min_ratio: f64,
        /// Warmup steps (DeepSpeed uses at least 2).
        #[serde(default = "warmup_num_steps_default")]
        warmup_num_steps: u64,
        /// `log` (DeepSpeed's default) or `linear`.
        #[serde(default)]
        warmup_type: WarmupType,
        /// Where the cosine ends; unset: `train.steps`.
        total_num_steps: Option<u64>,
    },
}

/// DeepSpeed's default `warmup_num_steps`.
pub const WARMUP_NUM_STEPS_DEFAULT: u64 = 1000;
/// DeepSpeed's default `cos_min_ratio`.
pub const COS_MIN_RATIO_DEFAULT: f64 = 0.0001;

fn warmup_num_steps_default() -> u64 {
    WARMUP_NUM_STEPS_DEFAULT
}

fn cos_min_ratio_default() -> f64 {
    COS_MIN_RATIO_DEFAULT
}

/// How DeepSpeed's schedulers rise during warmup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    /// `ln(i + 1) / ln(warmup_num_steps)` at iteration `i` (DeepSpeed's
    /// default).
    #[default]
    Log,
    /// `i / warmup_num_steps`.
    Linear,
}

impl Schedule {
    /// Checks the schedule's own settings.
    pub fn validate(&self) -> Result<()> {
        let (warmup_num_steps, total_num_steps) = match *self {
            Schedule::Cosine => return Ok(()),
            Schedule::WarmupLr {
                warmup_min_lr,
                warmup_num_steps,
                ..
            }
            | Schedule::WarmupDecayLr {
                warmup_min_lr,
                warmup_num_steps,
                ..
            } => {
                if !(warmup_min_lr >= 0.0 && warmup_min_lr.is_finite()) {
                    return Err(bad(
                        "train.schedule.warmup_min_lr",
                        warmup_min_lr,
                        "use a finite learning rate >= 0",
                    ));
                }
                (warmup_num_steps, self.total_num_steps())
            }
            Schedule::WarmupCosineLr {
                warmup_min_ratio,
                cos_min_ratio,
                warmup_num_steps,
                total_num_steps,
                ..
            } => {
                for (key, ratio) in [
                    ("train.schedule.warmup_min_ratio", warmup_min_ratio),
                    ("train.schedule.cos_min_ratio", cos_min_ratio),
                ] {
                    if !(0.0..=1.0).contains(&ratio) {
                        return Err(bad(key, ratio, "use a ratio of train.lr from 0 to 1"));
                    }
                }
                (warmup_num_steps, total_num_steps)
            }
        };
        if warmup_num_steps == 0 {
            return Err(bad(
                "train.schedule.warmup_num_steps",
                0,
                "use at least 1 step (DeepSpeed refuses 0 too)",
            ));
        }
        if total_num_steps == Some(0) {
            return Err(bad(
                "train.schedule.total_num_steps",
                0,
                "use at least 1 step, or leave it unset to follow train.steps",
            ));
        }
        Ok(())
    }

    /// `total_num_steps` of the schedules that have one.
    fn total_num_steps(&self) -> Option<u64> {
        match *self {
            Schedule::WarmupDecayLr {
                total_num_steps, ..
            }
            | Schedule::WarmupCosineLr {
                total_num_steps, ..
            } => total_num_steps,
            Schedule::Cosine | Schedule::WarmupLr { .. } => None,
        }
    }
}

/// DeepSpeed's `last_batch_iteration` while strata runs step `step` (from
/// 1): `step - 2`; `None` is -1, the value before the first `step()`.
fn deepspeed_iteration(step: u64) -> Option<u64> {
    step.checked_sub(2)
}

/// The warmup DeepSpeed's three schedulers share.
struct Warmup {
    /// `max(2, warmup_num_steps)`, as DeepSpeed clamps it.
    steps: u64,
    kind: WarmupType,
}

impl Warmup {
    fn new(warmup_num_steps: u64, kind: WarmupType) -> Warmup {
        Warmup {
            steps: warmup_num_steps.max(2),
            kind,
        }
    }

    /// The warmup fraction at iteration `i`, or `after` past the warmup.
    /// The operations are DeepSpeed's, in its order, so that the values
    /// agree to the last bit on the same libm.
    fn gamma(&self, i: u64, after: f64) -> f64 {
        if i >= self.steps {
            return after;
        }
        match self.kind {
            WarmupType::Log => (1.0 / (self.steps as f64).ln()) * ((i + 1) as f64).ln(),
            WarmupType::Linear => i as f64 / self.steps as f64,
        }
    }
}

/// The `[placement]` table: where each class of model state lives, and how
/// far ahead the plan fetches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementConfig {
    /// bf16 parameter shards (the compute copies).
    pub params: Placement,
    /// fp32 master weights and Adam moments; the optimizer runs on the CPU
    /// unless this is `device`.
    pub optimizer: Placement,
    /// Ops the plan may fetch ahead.
    pub prefetch_ops: u32,
    /// Ops ahead of backward that offloaded activations are fetched.
    pub activation_horizon_ops: u32,
    /// Host memory, out of `host.budget`, that keeps the optimizer states a
    /// late update just wrote (the first blocks', as many as fit) until the
    /// next step's update reads them, so that it does not wait for the
    /// drive; their write-backs wait for backward. Only with `optimizer =
    /// "nvme"`. `"auto"`: a quarter of the host budget, or none when the
    /// plans do not fit beside it; `0`: off.
    pub state_cache: StateCache,
}

/// The `[optim]` table: how the CPU optimizer runs and keeps its states.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Threads of each rank's CPU optimizer pool; 0: the physical cores
    /// this process may use less two (left to the kernel-launch thread and
    /// the movers), shared among the ranks, at least one.
    pub threads: u32,
    /// How the optimizer states are kept.
    pub state_dtype: StateDtype,
    /// Seeds the stochastic rounding of bf16 states; absent: `train.seed`.
    /// Runs that differ only here differ only by their rounding, which is
    /// how to measure what rounding noise alone does to a loss curve.
    pub rounding_seed: Option<u64>,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            threads: 0,
            state_dtype: StateDtype::Fp32,
            rounding_seed: None,
        }
    }
}

/// [`PlacementConfig::state_cache`]: a size, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SizeOrWord", into = "SizeOrWord")]
pub enum StateCache {
    /// A quarter of the host budget, or none when the plans need it.
    Auto,
    /// This many bytes.
    Bytes(u64),
}

/// How a [`StateCache`] is written: `"auto"`, `"160MiB"` or bytes.
#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum SizeOrWord {
    Bytes(u64),
    Text(String),
}

impl TryFrom<SizeOrWord> for StateCache {
    type Error = String;

    fn try_from(value: SizeOrWord) -> std::result::Result<Self, String> {
        match value {
            SizeOrWord::Bytes(bytes) => Ok(StateCache::Bytes(bytes)),
            SizeOrWord::Text(text) if text == "auto" => Ok(StateCache::Auto),
            SizeOrWord::Text(text) => text
                .parse::<ByteSize>()
                .map(|size| StateCache::Bytes(size.0))
                .map_err(|err| format!("placement.state_cache: {err}, or \"auto\"")),
        }
    }
}

impl From<StateCache> for SizeOrWord {
    fn from(cache: StateCache) -> Self {
        match cache {
            StateCache::Auto => SizeOrWord::Text("auto".into()),
            StateCache::Bytes(bytes) => SizeOrWord::Text(ByteSize(bytes).to_string()),
        }
    }
}

impl Default for PlacementConfig {
    fn default() -> Self {
        PlacementConfig {
            params: Placement::Cpu,
            optimizer: Placement::Nvme,
            prefetch_ops: 4,
            activation_horizon_ops: 2,
            state_cache: StateCache::Auto,
        }
    }
}

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
        }
    }
}

/// An optimizer or loss-scaler hyperparameter refused by strata-optim,
/// under the `[train]` key it comes from (`value`: what to show when the
/// error names none of them).
fn named(err: strata_optim::OptimError, value: impl ToString) -> TrainError {
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

    /// Checks ranges and the relations between fields (not yet whether
    /// the placement fits: [`crate::engine::Engine::new`] plans that).
    pub fn validate(&self) -> Result<()> {
        self.model.build()?;
        let t = &self.train;
        if t.steps == 0 {
            return Err(bad("train.steps", t.steps, "run at least 1 step"));
        }
        if !(1..=MICRO_BATCH_MAX).contains(&t.micro_batch) {
            return Err(bad(
                "train.micro_batch",
                t.micro_batch,
                format!("use 1 to {MICRO_BATCH_MAX} sequences"),
            ));
        }
        if !(1..=GRAD_ACCUMULATION_MAX).contains(&t.grad_accumulation) {
            return Err(bad(
                "train.grad_accumulation",
                t.grad_accumulation,
                format!("use 1 to {GRAD_ACCUMULATION_MAX}"),
            ));
        }
        if !(1..=RANKS_MAX).contains(&t.ranks) {
            return Err(bad("train.ranks", t.ranks, format!("use 1 to {RANKS_MAX}")));
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            return Err(bad(
                "train.lr",
                t.lr,
                "use a positive, finite learning rate",
            ));
        }
        if t.schedule == Schedule::Cosine && !(t.lr_min >= 0.0 && t.lr_min <= t.lr) {
            return Err(bad("train.lr_min", t.lr_min, "use 0 to train.lr"));
        }
        t.schedule.validate()?;
        if !(0.0..=LOCK_WAIT_S_MAX).contains(&t.lock_wait_s) {
            return Err(bad(
                "train.lock_wait_s",
                t.lock_wait_s,
                format!("use 0 to {LOCK_WAIT_S_MAX} seconds"),
            ));
        }
        if !(t.clip_norm >= 0.0 && t.clip_norm.is_finite()) {
            return Err(bad(
                "train.clip_norm",
                t.clip_norm,
                "use 0 (off) or a positive norm",
            ));
        }
        t.adam(t.lr).validate().map_err(|err| named(err, t.lr))?;
        strata_optim::LossScaler::new(t.scaler()).map_err(|err| named(err, t.loss_scale))?;
        if t.loss_scale_dynamic && t.loss_scale_hysteresis == 0 {
            return Err(bad(
                "train.loss_scale_hysteresis",
                0,
                "use at least 1 (back off at the first overflow)",
            ));
        }
        if t.loss_scale_dynamic && !(t.loss_scale_min > 0.0 && t.loss_scale_min <= t.loss_scale) {
            return Err(bad(
                "train.loss_scale_min",
                t.loss_scale_min,
                format!(
                    "use a scale above 0 and at most train.loss_scale ({})",
                    t.loss_scale
                ),
            ));
        }
        if self.device.kind == DeviceChoice::Cuda {
            self.cuda_constraints()?;
        }
        if let (Some(seed), false) = (
            self.optim.rounding_seed,
            self.optim.state_dtype.stochastic(),
        ) {
            return Err(bad(
                "optim.rounding_seed",
                seed,
                format!(
                    "optim.state_dtype = {:?} rounds nothing stochastically: remove optim.rounding_seed, or set optim.state_dtype = \"bf16-moments\" or \"bf16\"",
                    self.optim.state_dtype.name()
                ),
            ));
        }
        if self.uses_nvme() && self.nvme.is_none() {
            return Err(bad(
                "placement",
                "nvme",
                "add an [nvme] table with dirs, or place params and optimizer on device or cpu",
            ));
        }
        if let StateCache::Bytes(bytes) = self.placement.state_cache
            && bytes >= self.host.budget.0
        {
            return Err(bad(
                "placement.state_cache",
                ByteSize(bytes),
                format!(
                    "it must leave the plans part of host.budget ({}): lower it, or use \"auto\"",
                    self.host.budget
                ),
            ));
        }
        self.rank_runtime(0, 0)?.validate()?;
        self.check_memory()
    }

    /// Refuses, by a closed-form count and before anything proportional to
    /// the model is planned or allocated, a model and batch whose rank
    /// cannot fit its tiers: the model states each tier holds between uses
    /// (two bf16 parameter sets, two optimizer-state sets, the fp32
    /// gradient) and, on the device, the least compute workspace (one
    /// block's gathered parameters and gradient, the streams between
    /// blocks). The counts are lower bounds: what passes may still not fit
    /// the plan, which says so with its own numbers. Needs the limits
    /// [`validate`](Self::validate) checks first (they keep every count
    /// within 64 bits; the arithmetic saturates regardless).
    fn check_memory(&self) -> Result<()> {
        let model = self.model.build()?;
        let world = self.train.ranks as u64;
        let groups: Vec<u64> = model.groups().iter().map(|g| g.params() as u64).collect();
        // Every group is cut into `world` equal shards (padded).
        let shard = |params: u64| params.div_ceil(world);
        let shard_params = groups
            .iter()
            .fold(0u64, |sum, &params| sum.saturating_add(shard(params)));
        let state_bytes = self.optim.state_dtype.bytes_per_param() as u64;
        let mut homed = [0u64; 3];
        let mut add = |tier: Tier, bytes_per_param: u64| {
            let bytes = shard_params.saturating_mul(bytes_per_param);
            homed[tier.index()] = homed[tier.index()].saturating_add(bytes);
        };
        add(self.placement.params.tier(), 2 * 2);
        add(self.placement.optimizer.tier(), 2 * state_bytes);
        let grads = if self.placement.optimizer == Placement::Device {
            Tier::Device
        } else {
            Tier::Host
        };
        add(grads, 4);
        let group_max = shard(groups.iter().copied().max().unwrap_or(0)).saturating_mul(world);
        let stream = [self.train.micro_batch, model.seq(), model.stream_width()]
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(d as u64));
        let in_flight = self.train.in_flight() as u64;
        // Gathered parameters and gradient (fp32), y and dx, and each
        // micro-batch in flight's x and dy (fp32).
        let workspace = group_max
            .saturating_mul(8)
            .saturating_add(stream.saturating_mul(4).saturating_mul(2 + 2 * in_flight));
        let states = format!(
            "{} parameters per rank: bf16 parameters x2 sets on {:?}, {:?} optimizer states x2 on {:?}, fp32 gradients",
            shard_params, self.placement.params, self.optim.state_dtype, self.placement.optimizer
        );
        let device_needed = homed[Tier::Device.index()].saturating_add(workspace);
        if device_needed > self.device.budget.0 {
            return Err(TrainError::Memory {
                what: "the model states placed on the device and the compute workspace".into(),
                tier: "device",
                needed_bytes: device_needed,
                budget_key: "device.budget",
                budget_bytes: self.device.budget.0,
                detail: format!(
                    "{} bytes of model states ({states}) and a workspace of at least {workspace} bytes (one block's gathered fp32 parameters and gradient, {} fp32 activations per stream: micro_batch x seq x hidden)",
                    homed[Tier::Device.index()],
                    stream
                ),
                fix: "raise device.budget, place params or optimizer on cpu or nvme, use more train.ranks, or make the model or train.micro_batch smaller".into(),
            });
        }
        let tiers: [(Tier, &'static str, &'static str, u64); 2] = [
            (Tier::Host, "host", "host.budget", self.host.budget.0),
            (
                Tier::Nvme,
                "nvme",
                "nvme.capacity",
                self.nvme.as_ref().map_or(0, |n| n.capacity.0),
            ),
        ];
        for (tier, name, key, budget) in tiers {
            let needed = homed[tier.index()];
            if needed > budget {
                return Err(TrainError::Memory {
                    what: "the model states placed there".into(),
                    tier: name,
                    needed_bytes: needed,
                    budget_key: key,
                    budget_bytes: budget,
                    detail: states,
                    fix: format!(
                        "raise {key}, place params or optimizer elsewhere, use more train.ranks, or make the model smaller"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Whether a placement puts model states on NVMe: the NVMe tier is
    /// opened (its directories locked, its swap files made) only then.
    pub fn uses_nvme(&self) -> bool {
        [self.placement.params, self.placement.optimizer].contains(&Placement::Nvme)
    }

    /// What a run on a CUDA device cannot do yet: several ranks (no NCCL
    /// yet), or optimizer states on the device in another dtype than fp32.
    fn cuda_constraints(&self) -> Result<()> {
        if self.train.ranks > 1 {
            return Err(bad(
                "train.ranks",
                self.train.ranks,
                "device.kind = \"cuda\" trains one rank for now (collectives between GPUs need NCCL, not built yet): set train.ranks = 1, or device.kind = \"cpu\"",
            ));
        }
        if self.placement.optimizer == Placement::Device
            && self.optim.state_dtype != StateDtype::Fp32
        {
            return Err(bad(
                "optim.state_dtype",
                format!("{:?}", self.optim.state_dtype.name()),
                "optimizer states on a CUDA device are fp32 for now (the device AdamW kernel keeps fp32 master weights and moments): set optim.state_dtype = \"fp32\", or place the optimizer on cpu or nvme",
            ));
        }
        Ok(())
    }

    /// This config with `device.kind = "auto"` made `cuda` or `cpu`: the
    /// GPU when a driver and a device answer and the run can train there
    /// ([`TrainConfig::cuda_constraints`]), else the CPU device, with the
    /// reason (`None` when nothing was decided or the GPU was taken). The
    /// engine still goes to the CPU device when the GPU's backend does not
    /// open (an architecture strata does not compile for, no cuBLASLt or
    /// NVRTC, a bad ordinal).
    pub fn with_device_resolved(&self) -> (TrainConfig, Option<String>) {
        self.with_device_resolved_by(strata_device::cuda::probe_device)
    }

    /// [`TrainConfig::with_device_resolved`] with `probe` telling whether a
    /// GPU answers (and why not).
    fn with_device_resolved_by(
        &self,
        probe: impl FnOnce() -> std::result::Result<(), String>,
    ) -> (TrainConfig, Option<String>) {
        let mut resolved = self.clone();
        if self.device.kind != DeviceChoice::Auto {
            return (resolved, None);
        }
        let why_not = match self.cuda_constraints() {
            Err(err) => Some(err.to_string()),
            Ok(()) => probe().err(),
        };
        resolved.device.kind = match why_not {
            None => DeviceChoice::Cuda,
            Some(_) => DeviceChoice::Cpu,
        };
        (resolved, why_not)
    }

    /// Rank `rank`'s runtime settings with `workspace_bytes` of the device
    /// budget held for compute buffers (the rest is the tier the plan
    /// uses); each rank swaps to its own subdirectory.
    pub fn rank_runtime(&self, rank: usize, workspace_bytes: u64) -> Result<RuntimeConfig> {
        let device_budget = self.device.budget.0;
        if device_budget == 0 {
            return Err(bad(
                "device.budget",
                self.device.budget,
                "the device needs room for the compute workspace (one block's activations, gathered parameters and gradients) and the tensors the plan places there: give it a size, e.g. \"256MiB\"",
            ));
        }
        if workspace_bytes >= device_budget {
            return Err(bad(
                "device.budget",
                self.device.budget,
                format!(
                    "the compute workspace alone needs {workspace_bytes} bytes (one block's activations, gathered parameters and gradients): raise device.budget above that, or lower train.micro_batch or model.seq"
                ),
            ));
        }
        let nvme = self
            .nvme
            .clone()
            .filter(|_| self.uses_nvme())
            .map(|mut nvme| {
                nvme.dirs = nvme
                    .dirs
                    .iter()
                    .map(|d| d.join(format!("rank{rank}")))
                    .collect();
                nvme
            });
        let mut host = self.host.clone();
        if host.classes.is_empty() {
            // Shards are megabytes, not powers of two: one class of 256 KiB
            // buffers (also the NVMe request size) wastes at most that per
            // tensor, where size classes would run one class dry.
            host.classes = vec![strata_runtime::ClassConfig {
                buffer_size: ByteSize(HOST_BUFFER_BYTES),
                bytes: ByteSize(host.budget.0 / HOST_BUFFER_BYTES * HOST_BUFFER_BYTES),
            }];
        }
        Ok(RuntimeConfig {
            device: DeviceConfig {
                budget: ByteSize(device_budget - workspace_bytes),
                // The engine resolves `auto` first
                // (`with_device_resolved`); left unresolved, the CPU device.
                kind: match self.device.kind {
                    DeviceChoice::Cuda => DeviceChoice::Cuda,
                    DeviceChoice::Cpu | DeviceChoice::Auto => DeviceChoice::Cpu,
                },
                ..self.device.clone()
            },
            host,
            nvme,
            runtime: self.runtime.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value of the wrong type or an unknown key is shown with its line
    /// and section (serde's message names neither the key nor the table).
    #[test]
    fn parse_errors_show_the_line_and_its_section() {
        let err = TrainConfig::from_toml("[train]\nsteps = 3\n\n[optim]\nthreads = -1\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("at line 5 (`threads = -1`, in [optim])"),
            "{err}"
        );
        let err = TrainConfig::from_toml("[train]\nstepz = 3\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("stepz") && err.contains("in [train])"),
            "{err}"
        );
    }

    /// Optimizer and loss-scale values strata-optim refuses are named by
    /// their own `[train]` key and value (not `train = <lr>`), and a scale
    /// whose reciprocal overflows is refused here, not at the first step.
    #[test]
    fn refused_hyperparameters_name_their_own_key_and_value() {
        let text = |edit: &dyn Fn(&mut TrainConfig)| {
            let mut config = TrainConfig::default();
            edit(&mut config);
            config.validate().unwrap_err().to_string()
        };
        type Edit = dyn Fn(&mut TrainConfig);
        let cases: [(&Edit, &str); 6] = [
            (
                &|c| c.train.beta1 = 1.5,
                "train.beta1 = 1.5: beta1 must be in [0, 1)",
            ),
            (&|c| c.train.beta2 = -0.1, "train.beta2 = -0.1"),
            (&|c| c.train.eps = f64::NAN, "train.eps = NaN"),
            (&|c| c.train.weight_decay = -1.0, "train.weight_decay = -1"),
            (
                &|c| c.train.loss_scale = f32::NAN,
                "train.loss_scale = NaN: loss_scale must be",
            ),
            (
                &|c| {
                    c.train.loss_scale = 1e-45;
                    c.train.loss_scale_min = 1e-45;
                },
                "train.loss_scale = 1.401298464324817e-45: loss_scale must be finite and at least 1/f32::MAX",
            ),
        ];
        for (edit, expected) in cases {
            let got = text(edit);
            assert!(got.contains(expected), "{got}");
        }
    }

    /// `auto` takes the GPU when one answers and the run can train there,
    /// else the CPU device with the reason; `cpu` and `cuda` stay as asked.
    #[test]
    fn auto_takes_the_gpu_only_when_one_answers_and_the_run_fits_it() {
        let gpu = || Ok(());
        let none = || Err("the CUDA driver reports no device".to_string());
        let mut config = TrainConfig::default();
        config.device.kind = DeviceChoice::Auto;
        let (resolved, why) = config.with_device_resolved_by(gpu);
        assert_eq!((resolved.device.kind, why), (DeviceChoice::Cuda, None));
        let (resolved, why) = config.with_device_resolved_by(none);
        assert_eq!(resolved.device.kind, DeviceChoice::Cpu);
        assert!(why.unwrap().contains("no device"));
        // What CUDA cannot run yet goes to the CPU device, GPU or not.
        let mut ranks = config.clone();
        ranks.train.ranks = 2;
        let (resolved, why) = ranks.with_device_resolved_by(gpu);
        assert_eq!(resolved.device.kind, DeviceChoice::Cpu);
        assert!(why.unwrap().contains("train.ranks"));
        let mut states = config.clone();
        states.placement.optimizer = Placement::Device;
        states.optim.state_dtype = StateDtype::Bf16;
        let (resolved, why) = states.with_device_resolved_by(gpu);
        assert_eq!(resolved.device.kind, DeviceChoice::Cpu);
        assert!(why.unwrap().contains("optim.state_dtype"));
        for kind in [DeviceChoice::Cpu, DeviceChoice::Cuda] {
            config.device.kind = kind;
            let (resolved, why) = config.with_device_resolved_by(none);
            assert_eq!((resolved.device.kind, why), (kind, None));
        }
    }
}
