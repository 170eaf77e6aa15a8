//! The step's numbers: the loss scale, and the losses and gradient sums of
//! squares the device computes, read at the step's barrier (the oldest
//! sooner, past [`SCALARS_PENDING_MAX`]) so that the host does not wait
//! for the device after every micro-batch.

use std::collections::VecDeque;

use strata_comm::Collective;
use strata_kernels::Readback;
use strata_optim::{LossScaler, LossScalerConfig};

/// A loss scaler's state as a checkpoint keeps it: scale, steps since the
/// last overflow, hysteresis left.
pub(super) type ScalerState = (f32, u32, u32);

use crate::error::{Result, TrainError};

/// Device scalars that may wait to be read at once (a quarter of the CUDA
/// backend's readback slots).
pub(super) const SCALARS_PENDING_MAX: usize = 16;

/// Where a device scalar goes once read.
#[derive(Clone, Copy, Debug)]
pub(super) enum Scalar {
    /// A micro-batch's mean loss, added to the step's.
    Loss,
    /// Group `g`'s gradient sum of squares.
    Norm(usize),
}

/// The loss scaler and the step's pending and summed scalars.
pub(super) struct Loss {
    scaler: LossScaler,
    /// The step's losses, summed in the order the micro-batches ran (all
    /// ranks' after the barrier).
    loss_sum: f64,
    /// Per group, its gradient's sum of squares.
    sum_squares: Vec<f64>,
    /// Computed on the device, not read yet.
    scalars: VecDeque<(Scalar, Readback)>,
    /// With loss masks: the weight of each micro-batch's mean (its rows
    /// over the step's counted targets on every rank), so that the step's
    /// loss is the mean over its counted targets; none: every target
    /// counts and the step's loss is the mean of the micro-batches'.
    per_row: Option<f64>,
}

impl Loss {
    pub(super) fn new(scaler: LossScalerConfig, groups: usize) -> Result<Loss> {
        Ok(Loss {
            scaler: LossScaler::new(scaler)?,
            loss_sum: 0.0,
            sum_squares: vec![0.0; groups],
            scalars: VecDeque::with_capacity(SCALARS_PENDING_MAX),
            per_row: None,
        })
    }

    /// Starts a step: nothing summed, nothing pending (what a step that
    /// failed part way left nothing will read), each micro-batch's mean
    /// weighted by `per_row` (loss masks) or not. Returns its loss scale.
    pub(super) fn begin_step(&mut self, per_row: Option<f64>) -> f32 {
        self.loss_sum = 0.0;
        self.sum_squares.fill(0.0);
        self.scalars.clear();
        self.per_row = per_row;
        self.scaler.scale()
    }

    /// The gradient scale of a micro-batch's head, one of `micro_batches`
    /// over every rank: the loss scale times the micro-batch's share of
    /// the step's loss.
    pub(super) fn head_scale(&self, micro_batches: usize) -> f32 {
        match self.per_row {
            None => self.scaler.scale() / micro_batches as f32,
            Some(per_row) => (f64::from(self.scaler.scale()) * per_row) as f32,
        }
    }

    /// Keeps a scalar the device computes, to read at the barrier; past
    /// [`SCALARS_PENDING_MAX`] pending, reads the oldest first (long done).
    pub(super) fn defer(&mut self, into: Scalar, value: Readback) -> Result<()> {
        if self.scalars.len() == SCALARS_PENDING_MAX {
            self.read_oldest()?;
        }
        self.scalars.push_back((into, value));
        Ok(())
    }

    fn read_oldest(&mut self) -> Result<()> {
        let (into, value) = self.scalars.pop_front().expect("a scalar pending");
        let value = value.get()?;
        match into {
            // Added in the order the micro-batches ran.
            Scalar::Loss => self.loss_sum += value * self.per_row.unwrap_or(1.0),
            Scalar::Norm(g) => self.sum_squares[g] = value,
        }
        Ok(())
    }

    /// At the barrier: reads every pending scalar, in the order they were
    /// computed, and sums the gradients' squares and the losses over every
    /// rank. Returns the global sum of squares. A rank whose shards are a
    /// replica's copy (`holds_norm` false: hybrid sharding's other copies)
    /// adds its losses but not its squares, which the first copy counts.
    pub(super) fn reduce(&mut self, collective: &dyn Collective, holds_norm: bool) -> Result<f64> {
        while !self.scalars.is_empty() {
            self.read_oldest()?;
        }
        let squares = match holds_norm {
            true => self.sum_squares.iter().sum::<f64>(),
            false => 0.0,
        };
        let mut sums = [squares, self.loss_sum];
        collective.all_reduce_scalars(&mut sums)?;
        self.loss_sum = sums[1];
        Ok(sums[0])
    }

    /// Ends a step of `micro_batches` micro-batches over every rank: its
    /// mean loss (over its counted targets, with loss masks), the scale backed off after an overflow (`skipped`) or
    /// grown. A dynamic scale that overflows at its floor cannot go lower:
    /// the gradients are not finite at any scale (a static one skips on).
    pub(super) fn finish(
        &mut self,
        step: u64,
        skipped: bool,
        dynamic: bool,
        micro_batches: f64,
    ) -> Result<f64> {
        let loss = match self.per_row {
            None => self.loss_sum / micro_batches,
            Some(_) => self.loss_sum,
        };
        if skipped && dynamic && self.scaler.at_floor() {
            return Err(TrainError::Diverged {
                step,
                loss_scale: self.scaler.scale(),
                loss,
            });
        }
        self.scaler.update(skipped);
        Ok(loss)
    }

    /// The scaler's state, for a checkpoint.
    pub(super) fn scaler_state(&self) -> ScalerState {
        self.scaler.state()
    }

    /// Restores the scaler a checkpoint saved.
    pub(super) fn restore(&mut self, state: ScalerState) -> Result<()> {
        Ok(self.scaler.restore(state)?)
    }
}
