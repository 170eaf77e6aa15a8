//! `[train]`: batch, steps, the optimizer's hyperparameters and the
//! loss scale; the learning rate at each step.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use strata_optim::{AdamConfig, LossScalerConfig};

pub use strata_scheduler::Checkpointing;

use super::schedule::{Warmup, deepspeed_iteration};
use super::*;

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
    /// Sequences every rank together reads in a step (`ranks x
    /// micro_batch x grad_accumulation`): the global batch.
    pub fn sequences_per_step(&self) -> usize {
        self.ranks * self.micro_batch * self.grad_accumulation
    }

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

    /// Steps of the schedule's warmup (`warmup_steps`, or a DeepSpeed
    /// schedule's `warmup_num_steps`); None for a schedule without one.
    pub fn warmup_len(&self) -> Option<u64> {
        match self.schedule {
            Schedule::Cosine => Some(self.warmup_steps),
            Schedule::WarmupLr {
                warmup_num_steps, ..
            }
            | Schedule::WarmupDecayLr {
                warmup_num_steps, ..
            }
            | Schedule::WarmupCosineLr {
                warmup_num_steps, ..
            } => Some(warmup_num_steps),
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
