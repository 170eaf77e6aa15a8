//! `[train.schedule]`: how the learning rate moves over the steps
//! (strata's cosine, DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR).

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::error::bad;

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
pub(super) fn deepspeed_iteration(step: u64) -> Option<u64> {
    step.checked_sub(2)
}

/// The warmup DeepSpeed's three schedulers share.
pub(super) struct Warmup {
    /// `max(2, warmup_num_steps)`, as DeepSpeed clamps it.
    pub(super) steps: u64,
    kind: WarmupType,
}

impl Warmup {
    pub(super) fn new(warmup_num_steps: u64, kind: WarmupType) -> Warmup {
        Warmup {
            steps: warmup_num_steps.max(2),
            kind,
        }
    }

    /// The warmup fraction at iteration `i`, or `after` past the warmup.
    /// The operations are DeepSpeed's, in its order, so that the values
    /// agree to the last bit on the same libm.
    pub(super) fn gamma(&self, i: u64, after: f64) -> f64 {
        if i >= self.steps {
            return after;
        }
        match self.kind {
            WarmupType::Log => (1.0 / (self.steps as f64).ln()) * ((i + 1) as f64).ln(),
            WarmupType::Linear => i as f64 / self.steps as f64,
        }
    }
}
