//! The step's schedule: the ops of each shape of step and the plan the
//! tracker follows, planned up front ([`super::planner`]); where the step
//! running is (its shape, the op announced last, that boundary's planned
//! actions), which blocks recompute, and what the plans predict.

use strata_scheduler::{Action, Follow, Op, StepOp, StepTracker};

use crate::error::Result;

use super::Prediction;

/// The ops of every shape of step, the tracker, and the step's place in
/// them.
pub(super) struct StepSchedule {
    tracker: StepTracker,
    /// The ops of each shape of step, by [`super::steps::shape_index`].
    shapes: Vec<Vec<StepOp>>,
    /// Per shape, the position after which each tensor is no longer used.
    last_use: Vec<Vec<usize>>,
    /// The shape of the step running.
    shape: usize,
    /// Ops announced so far in this step (the op running is `position -
    /// 1`).
    position: usize,
    /// The plan's actions for the boundary the step is at.
    actions: Vec<Action>,
    /// Per block, whether its backward recomputes its forward
    /// (`train.checkpoint_activations`).
    recompute: Vec<bool>,
    prediction: Prediction,
}

impl StepSchedule {
    /// A schedule of `shapes` (each shape's ops and the positions of its
    /// tensors' last uses) primed in `tracker`.
    pub(super) fn new(
        tracker: StepTracker,
        shapes: Vec<(Vec<StepOp>, Vec<usize>)>,
        recompute: Vec<bool>,
        prediction: Prediction,
    ) -> StepSchedule {
        let (shapes, last_use) = shapes.into_iter().unzip();
        StepSchedule {
            tracker,
            shapes,
            last_use,
            shape: 0,
            position: 0,
            actions: Vec::with_capacity(1024),
            recompute,
            prediction,
        }
    }

    /// Lends the ops of shape `shape` to the step about to run it (given
    /// back by [`StepSchedule::end_ops`]).
    pub(super) fn take_ops(&mut self, shape: usize) -> Vec<StepOp> {
        self.shape = shape;
        std::mem::take(&mut self.shapes[shape])
    }

    /// Takes back the ops [`StepSchedule::take_ops`] lent.
    pub(super) fn end_ops(&mut self, ops: Vec<StepOp>) {
        self.shapes[self.shape] = ops;
    }

    /// The shape of the step running.
    pub(super) fn shape(&self) -> usize {
        self.shape
    }

    /// Starts the step at its first op: the actions planned before it.
    pub(super) fn begin_step(&mut self, first: &Op) {
        self.position = 0;
        self.actions.clear();
        if let Follow::Plan(actions) = self.tracker.begin_step_with(first) {
            self.actions.extend_from_slice(actions);
        }
    }

    /// Tells the tracker `op` starts: the actions planned for the boundary
    /// after it.
    pub(super) fn announce(&mut self, op: &Op) -> Result<()> {
        self.position += 1;
        self.actions.clear();
        if let Follow::Plan(actions) = self.tracker.op(op)? {
            self.actions.extend_from_slice(actions);
        }
        Ok(())
    }

    /// The actions planned for the boundary the step is at.
    pub(super) fn actions(&self) -> &[Action] {
        &self.actions
    }

    /// Ops announced so far in this step.
    pub(super) fn position(&self) -> usize {
        self.position
    }

    /// Whether the step's tensor `index` is past its last use.
    pub(super) fn past_last_use(&self, index: usize) -> bool {
        self.last_use[self.shape][index] <= self.position
    }

    /// Closes the step's trace.
    pub(super) fn end_step(&mut self) -> Result<()> {
        self.tracker.end_step()?;
        Ok(())
    }

    /// Whether block `b`'s backward recomputes its forward.
    pub(super) fn recomputes(&self, b: usize) -> bool {
        self.recompute[b]
    }

    /// What the plans predict.
    pub(super) fn prediction(&self) -> Prediction {
        self.prediction
    }
}
