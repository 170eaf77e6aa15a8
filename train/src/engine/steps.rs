//! Step assembly: the ops of each shape of step (which state set is
//! current, speculative updates or not, the last step's late updates or
//! not), each with the tensors it reads and writes, in the order the
//! engine runs them and the planner plans them.

use strata_scheduler as sched;
use strata_scheduler::{Mode, Op, Processor};

use super::Engine;
use super::config::{Placement, TrainSettings};
use super::tensors::{COPY_BYTES_PER_S, FLOPS_PER_S, grad_index, param_index, state_index};

/// What one op of the step does (`m`: micro-batch, `b`: block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Work {
    EmbedForward {
        m: usize,
    },
    BlockForward {
        m: usize,
        b: usize,
    },
    Head {
        m: usize,
    },
    BlockBackward {
        m: usize,
        b: usize,
    },
    EmbedBackward {
        m: usize,
    },
    /// Group `g`'s update: speculative (in this step's backward) or late
    /// (the last step's, in this step's forward).
    Optimizer {
        g: usize,
        late: bool,
    },
    Decide,
    Commit,
}

pub(super) struct StepOp {
    pub(super) work: Work,
    pub(super) op: Op,
}

impl Work {
    /// How the trace names it: what, the group, the micro-batch.
    pub(super) fn label(self) -> (&'static str, usize, Option<usize>) {
        match self {
            Work::EmbedForward { m } => ("embed forward", 0, Some(m)),
            Work::BlockForward { m, b } => ("block forward", b + 1, Some(m)),
            Work::Head { m } => ("head", 0, Some(m)),
            Work::BlockBackward { m, b } => ("block backward", b + 1, Some(m)),
            Work::EmbedBackward { m } => ("embed backward", 0, Some(m)),
            Work::Optimizer { g, late } => (optimizer_label(late), g, None),
            Work::Decide => ("decide", 0, None),
            Work::Commit => ("commit", 0, None),
        }
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

pub(super) fn access(tensor: usize, mode: Mode) -> sched::Access {
    sched::Access {
        tensor: tensor as u32,
        mode,
    }
}

pub(super) fn step_op(
    work: Work,
    name: String,
    processor: Processor,
    accesses: Vec<sched::Access>,
    compute_ns: u64,
) -> StepOp {
    StepOp {
        work,
        op: Op::new(name, processor, accesses, compute_ns),
    }
}

/// Micro-batches in flight at once: all of them with activation
/// checkpointing (their kept inputs are small), else one.
pub(super) fn in_flight(train: &TrainSettings) -> usize {
    if train.checkpoint_activations {
        train.grad_accumulation
    } else {
        1
    }
}

impl Engine {
    /// The ops of one shape of step: `current` set, updates `speculate`d
    /// in backward or not, the last step's `late` updates in forward or not.
    pub(super) fn step_ops(&self, current: usize, speculate: bool, late: bool) -> Vec<StepOp> {
        let layers = self.gpt.layers;
        let accumulation = self.config.train.grad_accumulation;
        let gpu = Processor::Gpu;
        let optimizer = match self.config.placement.optimizer {
            Placement::Device => Processor::Gpu,
            _ => Processor::Cpu,
        };
        let read = |tensor: usize| access(tensor, Mode::Read);
        let block_ns = (24.0
            * (self.config.train.micro_batch * self.gpt.seq) as f64
            * (self.gpt.hidden * self.gpt.hidden) as f64
            / FLOPS_PER_S
            * 1e9) as u64;
        let mut ops = Vec::new();
        let optimizer_op = |g: usize, late: bool| {
            let (from, to) = update_sets(current, late);
            let accesses = vec![
                read(grad_index(g)),
                read(state_index(g, from)),
                access(state_index(g, to), Mode::Write),
                access(param_index(g, to), Mode::Write),
            ];
            let compute_ns = (self.groups[g].shard as f64 * 32.0 / COPY_BYTES_PER_S * 1e9) as u64;
            let stage = if late { "late." } else { "" };
            let name = format!("optim.{stage}{}", self.groups[g].name);
            step_op(
                Work::Optimizer { g, late },
                name,
                optimizer,
                accesses,
                compute_ns,
            )
        };
        // With activation checkpointing every micro-batch is in flight at
        // once and runs block by block: a block's parameters come once per
        // pass, its gradient is summed while it is on the device. Without,
        // one micro-batch runs after another (one's activations alive).
        let in_flight = in_flight(&self.config.train);
        for first_mb in (0..accumulation).step_by(in_flight) {
            let micro_batches = first_mb..first_mb + in_flight;
            let last = micro_batches.end == accumulation;
            let embed = read(param_index(0, current));
            // Late updates run ahead of the first pass, group g's queued
            // before the ops of group g - 1, so that it overlaps them.
            let queue_late = |ops: &mut Vec<StepOp>, g: usize| {
                if late && first_mb == 0 && g <= layers {
                    ops.push(optimizer_op(g, true));
                }
            };
            queue_late(&mut ops, 0);
            queue_late(&mut ops, 1);
            for m in micro_batches.clone() {
                ops.push(step_op(
                    Work::EmbedForward { m },
                    format!("fwd.embed.mb{m}"),
                    gpu,
                    vec![embed],
                    block_ns / 8,
                ));
            }
            for b in 0..layers {
                queue_late(&mut ops, b + 2);
                for m in micro_batches.clone() {
                    let accesses = vec![
                        read(param_index(b + 1, current)),
                        access(self.saved_index(m, b), Mode::Write),
                    ];
                    ops.push(step_op(
                        Work::BlockForward { m, b },
                        format!("fwd.block{b}.mb{m}"),
                        gpu,
                        accesses,
                        block_ns,
                    ));
                }
            }
            for m in micro_batches.clone() {
                ops.push(step_op(
                    Work::Head { m },
                    format!("head.mb{m}"),
                    gpu,
                    vec![embed],
                    block_ns / 2,
                ));
            }
            for b in (0..layers).rev() {
                for m in micro_batches.clone() {
                    let grad_mode = if m == 0 { Mode::Write } else { Mode::Update };
                    let accesses = vec![
                        read(param_index(b + 1, current)),
                        read(self.saved_index(m, b)),
                        access(grad_index(b + 1), grad_mode),
                    ];
                    ops.push(step_op(
                        Work::BlockBackward { m, b },
                        format!("bwd.block{b}.mb{m}"),
                        gpu,
                        accesses,
                        3 * block_ns,
                    ));
                }
                if last && speculate {
                    ops.push(optimizer_op(b + 1, false));
                }
            }
            for m in micro_batches {
                let grad_mode = if m == 0 { Mode::Write } else { Mode::Update };
                ops.push(step_op(
                    Work::EmbedBackward { m },
                    format!("bwd.embed.mb{m}"),
                    gpu,
                    vec![access(grad_index(0), grad_mode)],
                    block_ns / 8,
                ));
            }
            if last && speculate {
                ops.push(optimizer_op(0, false));
            }
        }
        // The norm is summed as gradients are reduced: deciding and
        // committing touch no tensor.
        ops.push(step_op(
            Work::Decide,
            "decide".into(),
            optimizer,
            Vec::new(),
            1000,
        ));
        ops.push(step_op(
            Work::Commit,
            "commit".into(),
            optimizer,
            Vec::new(),
            1000,
        ));
        let decide = ops
            .iter_mut()
            .find(|s| s.work == Work::Decide)
            .expect("pushed above");
        decide.op.barrier = true;
        ops
    }
}
