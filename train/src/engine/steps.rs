//! Step assembly: the ops of each shape of step (which state set is
//! current, speculative updates or not, the last step's late updates or
//! not), each with the tensors it reads and writes, in the order the
//! engine runs them and the planner plans them.

use strata_scheduler as sched;
use strata_scheduler::{
    Mode, OpCost, Processor, StepModel, StepOp, StepShape, Updates, Work, build_forward_only,
    build_step,
};

use super::config::{Placement, TrainConfig};
use super::env::Env;
use super::tensors::{
    COPY_BYTES_PER_S, FLOPS_PER_S, grad_index, param_index, saved_index, state_index,
};
use crate::model::{Model, OUTER};

/// How the trace names an op's work: what, the group, the micro-batch.
pub(super) fn label(work: Work) -> (&'static str, usize, Option<usize>) {
    match work {
        Work::EmbedForward { m } => ("embed forward", OUTER, Some(m)),
        Work::Forward { m, layer, .. } => ("block forward", layer + 1, Some(m)),
        Work::Head { m } => ("head", OUTER, Some(m)),
        // A forward-only pass names its own ops (`evaluation.rs`).
        Work::Loss { m } => ("loss", OUTER, Some(m)),
        Work::Backward { m, layer, .. } => ("block backward", layer + 1, Some(m)),
        Work::EmbedBackward { m } => ("embed backward", OUTER, Some(m)),
        Work::Update { group, late } => (optimizer_label(late), group, None),
        Work::Norm => ("decide", 0, None),
        Work::Commit => ("commit", 0, None),
    }
}

pub(super) fn optimizer_label(late: bool) -> &'static str {
    if late { "late optimizer" } else { "optimizer" }
}

/// The sets an update reads and writes: a speculative one reads the
/// `current` set and writes the other; a late one (the last step's) reads
/// the set before and writes the current one.
pub(super) fn update_sets(current: usize, late: bool) -> (usize, usize) {
    if late {
        (1 - current, current)
    } else {
        (current, 1 - current)
    }
}

/// The index of a shape of step: which set is current, whether updates
/// are speculative, whether the last step's update runs late in this one.
pub(super) fn shape_index(current: usize, speculate: bool, late: bool) -> usize {
    current * 4 + usize::from(speculate) * 2 + usize::from(late)
}

pub(super) fn shape_of(index: usize) -> (usize, bool, bool) {
    (index / 4, index & 2 != 0, index & 1 != 0)
}

/// One shape of the engine's step as the step builder sees it.
struct EngineStep<'a> {
    env: &'a Env,
    /// Per block, whether its backward recomputes its forward.
    recompute: &'a [bool],
    /// The state set the step's compute reads.
    current: usize,
    /// One block's forward, estimated.
    block_ns: u64,
    optimizer: Processor,
}

impl StepModel for EngineStep<'_> {
    fn param(&self, group: usize) -> u32 {
        param_index(group, self.current) as u32
    }

    fn grad(&self, group: usize) -> u32 {
        grad_index(group) as u32
    }

    fn saved(&self, m: usize, layer: usize) -> u32 {
        saved_index(self.env.groups().len(), self.env.model().layers(), m, layer) as u32
    }

    fn update(&self, group: usize, late: bool) -> Vec<sched::Access> {
        let (from, to) = update_sets(self.current, late);
        let access = |tensor: usize, mode| sched::Access {
            tensor: tensor as u32,
            mode,
        };
        vec![
            access(grad_index(group), Mode::Read),
            access(state_index(group, from), Mode::Read),
            access(state_index(group, to), Mode::Write),
            access(param_index(group, to), Mode::Write),
        ]
    }

    fn name(&self, group: usize) -> String {
        self.env.groups()[group].name.clone()
    }

    fn cost(&self, work: Work) -> OpCost {
        let (gpu, block_ns) = (Processor::Gpu, self.block_ns);
        // The outer group's parts, relative to a block's forward as the
        // model says.
        let relative = |part: f64| (block_ns as f64 * part) as u64;
        let costs = self.env.model().outer_costs();
        match work {
            Work::EmbedForward { .. } | Work::EmbedBackward { .. } => {
                OpCost::compute(gpu, relative(costs.embed))
            }
            Work::Forward { .. } => OpCost::compute(gpu, block_ns),
            Work::Head { .. } => OpCost::compute(gpu, relative(costs.head)),
            // The head's forward alone: a third of its forward and backward.
            Work::Loss { .. } => OpCost::compute(gpu, relative(costs.head / 3.0)),
            // Twice the forward, and the forward again when it recomputes.
            Work::Backward { layer, .. } => {
                let recompute = u64::from(self.recompute[layer]);
                OpCost::compute(gpu, (2 + recompute) * block_ns)
            }
            Work::Update { group, .. } => {
                let shard = self.env.groups()[group].shard as f64;
                OpCost::compute(
                    self.optimizer,
                    (shard * 32.0 / COPY_BYTES_PER_S * 1e9) as u64,
                )
            }
            Work::Norm | Work::Commit => OpCost::compute(self.optimizer, 1000),
        }
    }
}

/// The ops of a forward-only pass (an evaluation) reading set `current`:
/// every micro-batch in flight, one block's forward costed at `block_ns`.
pub(super) fn eval_ops(env: &Env, block_ns: u64, current: usize) -> Vec<StepOp> {
    let model = EngineStep {
        env,
        recompute: &[],
        current,
        block_ns,
        optimizer: Processor::Cpu,
    };
    let in_flight = env.config().train.in_flight();
    build_forward_only(env.model().layers(), 1, in_flight, &model)
}

/// One block's forward of one micro-batch from its matrix FLOPs at
/// [`FLOPS_PER_S`]: the plans' cost when nothing was measured.
pub(super) fn estimated_block_ns(config: &TrainConfig, model: &dyn Model) -> u64 {
    let tokens = config.train.micro_batch * model.seq();
    (model.block_forward_flops(tokens) / FLOPS_PER_S * 1e9) as u64
}

/// The ops of one shape of step: `current` set, updates `speculate`d in
/// backward or not (then late, in the next step's forward), the last
/// step's `late` updates in forward or not; blocks that `recompute`, one
/// block's forward costed at `block_ns`. The norm is summed as gradients
/// are reduced: deciding there and committing touch no tensor.
pub(super) fn step_ops(
    env: &Env,
    recompute: &[bool],
    block_ns: u64,
    current: usize,
    speculate: bool,
    late: bool,
) -> Vec<StepOp> {
    let train = &env.config().train;
    let shape = StepShape {
        layers: env.model().layers(),
        parts: 1,
        micro_batches: train.grad_accumulation,
        in_flight: train.in_flight(),
        updates: if speculate {
            Updates::InBackward
        } else {
            Updates::NextStep
        },
        late,
        norm: true,
        commit: true,
        workspace_grads: true,
    };
    let optimizer = match env.config().placement.optimizer {
        Placement::Device => Processor::Gpu,
        _ => Processor::Cpu,
    };
    let model = EngineStep {
        env,
        recompute,
        current,
        block_ns,
        optimizer,
    };
    build_step(&shape, &model)
}
