//! The one step builder: the ordered ops of one optimizer step of a decoder-only
//! model, each with the tensors it touches. The training engine runs what
//! it builds and `strata plan` simulates it; what differs between them
//! (tensor numbering, costs, which state set is current) comes in through
//! [`StepModel`], the order and the access pattern are decided here once.
//!
//! Groups are the units the optimizer updates: group 0 is the (tied)
//! embedding, group `1 + layer * parts + part` is part `part` of block
//! `layer` (the engine has one part per block; the cluster model has one per
//! linear layer and tile).

use crate::trace::{Access, Mode, Op, Processor};

/// What one op of a step does (`m`: micro-batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Work {
    /// The embedding gather of micro-batch `m`.
    EmbedForward {
        /// Micro-batch.
        m: usize,
    },
    /// Forward of one part of a block; in a training step the block's last
    /// part writes what its backward needs (the saved activations).
    Forward {
        /// Micro-batch.
        m: usize,
        /// Block.
        layer: usize,
        /// Part of the block.
        part: usize,
        /// Whether the block keeps what its backward needs: false in a
        /// forward-only pass ([`build_forward_only`]).
        keep: bool,
    },
    /// The output projection, loss and their backward.
    Head {
        /// Micro-batch.
        m: usize,
    },
    /// The output projection and the loss alone, no gradient (a
    /// forward-only pass).
    Loss {
        /// Micro-batch.
        m: usize,
    },
    /// Backward of one part of a block; the block's last part reads its
    /// saved activations (and recomputes from them with checkpointing).
    Backward {
        /// Micro-batch.
        m: usize,
        /// Block.
        layer: usize,
        /// Part of the block.
        part: usize,
    },
    /// The embedding's scatter-add of micro-batch `m`.
    EmbedBackward {
        /// Micro-batch.
        m: usize,
    },
    /// Group `group`'s optimizer update: in this step, or `late` (the last
    /// step's, run in this step's forward).
    Update {
        /// The group.
        group: usize,
        /// The last step's update.
        late: bool,
    },
    /// The global gradient norm: a barrier every later op waits for (the
    /// engine decides there whether its speculative updates stand).
    Norm,
    /// The speculative updates' outcome made final.
    Commit,
}

/// Where this step's updates run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Updates {
    /// In the last pass's backward, each group's as soon as its gradient
    /// is final (overlapped; speculative when a norm decides later).
    InBackward,
    /// After the norm, last group first.
    AfterNorm,
    /// Not in this step: the next step runs them late, in its forward.
    NextStep,
}

/// The shape of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    /// Transformer blocks (on this pipeline stage).
    pub layers: usize,
    /// Groups per block.
    pub parts: usize,
    /// Micro-batches per step (gradient accumulation).
    pub micro_batches: usize,
    /// Micro-batches run block by block together (all of them with
    /// activation checkpointing in the engine, else one); divides
    /// `micro_batches`.
    pub in_flight: usize,
    /// Where this step's updates run.
    pub updates: Updates,
    /// The last step's updates run in this step's forward, group `g + 1`'s
    /// queued before group `g`'s forward so that it overlaps it.
    pub late: bool,
    /// A norm barrier before the step ends (and before
    /// [`Updates::AfterNorm`] updates).
    pub norm: bool,
    /// A commit op after the norm.
    pub commit: bool,
    /// Every group's gradient is summed over the step's micro-batches in a
    /// workspace on the device and written to its tensor once, by the last
    /// micro-batch's backward (strata's engine: all micro-batches in one
    /// pass). Otherwise each micro-batch's backward updates the tensor (the
    /// first writes it; the head's writes the tied embedding's).
    pub workspace_grads: bool,
}

impl StepShape {
    /// Optimizer groups: the embedding and every part of every block.
    pub fn groups(&self) -> usize {
        1 + self.layers * self.parts
    }

    /// The group of `part` of block `layer`.
    pub fn group(&self, layer: usize, part: usize) -> usize {
        1 + layer * self.parts + part
    }
}

/// One op's cost and where it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpCost {
    /// What runs it.
    pub processor: Processor,
    /// Compute time.
    pub compute_ns: u64,
    /// Collective time before compute (the parameters' all-gather).
    pub gather_ns: u64,
    /// Collective time after compute (the gradients' reduce-scatter).
    pub reduce_ns: u64,
}

impl OpCost {
    /// Compute only, no collective.
    pub fn compute(processor: Processor, compute_ns: u64) -> OpCost {
        OpCost {
            processor,
            compute_ns,
            gather_ns: 0,
            reduce_ns: 0,
        }
    }
}

/// What the builder asks of the model: tensor numbers, names and costs.
pub trait StepModel {
    /// The parameters `group`'s compute reads.
    fn param(&self, group: usize) -> u32;
    /// `group`'s gradient.
    fn grad(&self, group: usize) -> u32;
    /// Block `layer`'s saved activations of micro-batch `m`.
    fn saved(&self, m: usize, layer: usize) -> u32;
    /// What `group`'s update (`late` or not) reads and writes.
    fn update(&self, group: usize, late: bool) -> Vec<Access>;
    /// `group`'s name, for op names.
    fn name(&self, group: usize) -> String;
    /// What `work` costs and where it runs.
    fn cost(&self, work: Work) -> OpCost;
}

/// One op of a step and the work it stands for.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOp {
    /// What it does.
    pub work: Work,
    /// Its tensors and costs, as the planner sees it.
    pub op: Op,
}

fn access(tensor: u32, mode: Mode) -> Access {
    Access { tensor, mode }
}

fn read(tensor: u32) -> Access {
    access(tensor, Mode::Read)
}

/// A gradient's first writer in a step writes it whole; later ones add.
fn grad_mode(first: bool) -> Mode {
    if first { Mode::Write } else { Mode::Update }
}

struct Builder<'a> {
    shape: &'a StepShape,
    model: &'a dyn StepModel,
    ops: Vec<StepOp>,
}

impl Builder<'_> {
    fn push(&mut self, work: Work, name: String, accesses: Vec<Access>) {
        let cost = self.model.cost(work);
        let op = Op {
            gather_ns: cost.gather_ns,
            reduce_ns: cost.reduce_ns,
            barrier: work == Work::Norm,
            ..Op::new(name, cost.processor, accesses, cost.compute_ns)
        };
        self.ops.push(StepOp { work, op });
    }

    fn update(&mut self, group: usize, late: bool) {
        let stage = if late { "late." } else { "" };
        let name = format!("optim.{stage}{}", self.model.name(group));
        let accesses = self.model.update(group, late);
        self.push(Work::Update { group, late }, name, accesses);
    }

    /// The last step's late update of `group`, in the first pass only.
    fn late(&mut self, group: usize, first_pass: bool) {
        if self.shape.late && first_pass && group < self.shape.groups() {
            self.update(group, true);
        }
    }

    /// The forward of `micro_batches`, block by block; a training step's
    /// blocks `keep` what their backward needs and its heads compute the
    /// gradient, a forward-only pass's ops (named `eval.*`) neither.
    fn forward(&mut self, micro_batches: std::ops::Range<usize>, keep: bool) {
        let (shape, model) = (self.shape, self.model);
        let first_pass = micro_batches.start == 0;
        let stage = if keep { "" } else { "eval." };
        self.late(0, first_pass);
        self.late(1, first_pass);
        for m in micro_batches.clone() {
            let name = format!("{stage}m{m}.fwd.{}", model.name(0));
            self.push(Work::EmbedForward { m }, name, vec![read(model.param(0))]);
        }
        for layer in 0..shape.layers {
            for part in 0..shape.parts {
                let group = shape.group(layer, part);
                self.late(group + 1, first_pass);
                for m in micro_batches.clone() {
                    let mut accesses = vec![read(model.param(group))];
                    if keep && part + 1 == shape.parts {
                        accesses.push(access(model.saved(m, layer), Mode::Write));
                    }
                    let name = format!("{stage}m{m}.fwd.{}", model.name(group));
                    let work = Work::Forward {
                        m,
                        layer,
                        part,
                        keep,
                    };
                    self.push(work, name, accesses);
                }
            }
        }
        for m in micro_batches {
            let mut accesses = vec![read(model.param(0))];
            if !keep {
                self.push(Work::Loss { m }, format!("eval.m{m}.loss"), accesses);
                continue;
            }
            if !shape.workspace_grads {
                accesses.push(access(model.grad(0), grad_mode(m == 0)));
            }
            self.push(Work::Head { m }, format!("m{m}.head"), accesses);
        }
    }

    fn backward(&mut self, micro_batches: std::ops::Range<usize>) {
        let (shape, model) = (self.shape, self.model);
        let last_pass = micro_batches.end == shape.micro_batches;
        let updates = last_pass && shape.updates == Updates::InBackward;
        for layer in (0..shape.layers).rev() {
            for part in (0..shape.parts).rev() {
                let group = shape.group(layer, part);
                for m in micro_batches.clone() {
                    let mut accesses = vec![read(model.param(group))];
                    match shape.workspace_grads {
                        true if m + 1 == shape.micro_batches => {
                            accesses.push(access(model.grad(group), Mode::Write));
                        }
                        true => {}
                        false => accesses.push(access(model.grad(group), grad_mode(m == 0))),
                    }
                    if part + 1 == shape.parts {
                        accesses.push(read(model.saved(m, layer)));
                    }
                    let name = format!("m{m}.bwd.{}", model.name(group));
                    self.push(Work::Backward { m, layer, part }, name, accesses);
                }
                if updates {
                    self.update(group, false);
                }
            }
        }
        for m in micro_batches {
            let accesses = match shape.workspace_grads {
                false => vec![access(model.grad(0), grad_mode(false))],
                true if m + 1 == shape.micro_batches => {
                    vec![access(model.grad(0), Mode::Write)]
                }
                true => Vec::new(),
            };
            let name = format!("m{m}.bwd.{}", model.name(0));
            self.push(Work::EmbedBackward { m }, name, accesses);
        }
        if updates {
            self.update(0, false);
        }
    }
}

/// The ops of one step of `shape`, in the order they run.
pub fn build_step(shape: &StepShape, model: &dyn StepModel) -> Vec<StepOp> {
    assert!(
        shape.in_flight > 0 && shape.micro_batches.is_multiple_of(shape.in_flight),
        "in-flight micro-batches ({}) must divide the step's {}",
        shape.in_flight,
        shape.micro_batches
    );
    assert!(shape.parts > 0, "a block has at least one part");
    assert!(
        !shape.workspace_grads || shape.in_flight == shape.micro_batches,
        "gradients summed in a workspace need every micro-batch in one pass"
    );
    let mut builder = Builder {
        shape,
        model,
        ops: Vec::new(),
    };
    for first in (0..shape.micro_batches).step_by(shape.in_flight) {
        let micro_batches = first..first + shape.in_flight;
        builder.forward(micro_batches.clone(), true);
        builder.backward(micro_batches);
    }
    if shape.norm {
        builder.push(Work::Norm, "grad-norm".into(), Vec::new());
    }
    if shape.updates == Updates::AfterNorm {
        for group in (0..shape.groups()).rev() {
            builder.update(group, false);
        }
    }
    if shape.commit {
        builder.push(Work::Commit, "commit".into(), Vec::new());
    }
    builder.ops
}

/// The ops of a forward-only pass (an evaluation) of `micro_batches`
/// micro-batches, all in flight block by block, through `layers` blocks of
/// `parts` groups: each micro-batch's embedding, every block's forward
/// keeping nothing, and its loss. No gradient, update, norm or commit;
/// every op reads its group's parameters and writes no tensor, and is
/// named `eval.*`, so that a tracker tells the pass from a training step
/// at its first op.
pub fn build_forward_only(
    layers: usize,
    parts: usize,
    micro_batches: usize,
    model: &dyn StepModel,
) -> Vec<StepOp> {
    assert!(parts > 0, "a block has at least one part");
    assert!(micro_batches > 0, "a pass has at least one micro-batch");
    let shape = StepShape {
        layers,
        parts,
        micro_batches,
        in_flight: micro_batches,
        updates: Updates::NextStep,
        late: false,
        norm: false,
        commit: false,
        workspace_grads: true,
    };
    let mut builder = Builder {
        shape: &shape,
        model,
        ops: Vec::new(),
    };
    builder.forward(0..micro_batches, false);
    builder.ops
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tensors: param g = g, grad g = 100 + g, saved (m, l) = 200 + 10m + l,
    /// update states 300 + g.
    struct Toy;

    impl StepModel for Toy {
        fn param(&self, group: usize) -> u32 {
            group as u32
        }
        fn grad(&self, group: usize) -> u32 {
            100 + group as u32
        }
        fn saved(&self, m: usize, layer: usize) -> u32 {
            (200 + 10 * m + layer) as u32
        }
        fn update(&self, group: usize, _late: bool) -> Vec<Access> {
            vec![
                read(self.grad(group)),
                access(300 + group as u32, Mode::Update),
            ]
        }
        fn name(&self, group: usize) -> String {
            format!("g{group}")
        }
        fn cost(&self, work: Work) -> OpCost {
            let processor = match work {
                Work::Update { .. } => Processor::Cpu,
                _ => Processor::Gpu,
            };
            OpCost::compute(processor, 1)
        }
    }

    fn shape() -> StepShape {
        StepShape {
            layers: 2,
            parts: 2,
            micro_batches: 2,
            in_flight: 1,
            updates: Updates::InBackward,
            late: false,
            norm: false,
            commit: false,
            workspace_grads: false,
        }
    }

    fn names(ops: &[StepOp]) -> Vec<&str> {
        ops.iter().map(|s| s.op.name.as_str()).collect()
    }

    #[test]
    fn one_micro_batch_at_a_time_with_updates_overlapped_in_the_last_backward() {
        let ops = build_step(&shape(), &Toy);
        let mut expected = Vec::new();
        for m in 0..2 {
            expected.push(format!("m{m}.fwd.g0"));
            expected.extend((1..5).map(|g| format!("m{m}.fwd.g{g}")));
            expected.push(format!("m{m}.head"));
            for g in (1..5).rev() {
                expected.push(format!("m{m}.bwd.g{g}"));
                if m == 1 {
                    expected.push(format!("optim.g{g}"));
                }
            }
            expected.push(format!("m{m}.bwd.g0"));
        }
        expected.push("optim.g0".into());
        assert_eq!(names(&ops), expected);
        // The block's last part saves and reads back; the first micro-batch
        // writes gradients whole and the second adds; the head writes the
        // embedding's gradient first.
        let op = |name: &str| &ops.iter().find(|s| s.op.name == name).unwrap().op;
        assert_eq!(
            op("m1.fwd.g2").accesses,
            [read(2), access(210, Mode::Write)]
        );
        assert_eq!(op("m0.fwd.g1").accesses, [read(1)]);
        assert_eq!(
            op("m0.bwd.g4").accesses,
            [read(4), access(104, Mode::Write), read(201)]
        );
        assert_eq!(
            op("m1.bwd.g3").accesses,
            [read(3), access(103, Mode::Update)]
        );
        assert_eq!(op("m0.head").accesses[1], access(100, Mode::Write));
        assert_eq!(op("m0.bwd.g0").accesses, [access(100, Mode::Update)]);
        assert!(ops.iter().all(|s| !s.op.barrier));
        assert_eq!(
            ops.iter()
                .filter(|s| s.op.processor == Processor::Cpu)
                .count(),
            5
        );
    }

    #[test]
    fn updates_after_the_norm_run_last_group_first_behind_a_barrier() {
        let shape = StepShape {
            updates: Updates::AfterNorm,
            norm: true,
            ..shape()
        };
        let ops = build_step(&shape, &Toy);
        let norm = ops.iter().position(|s| s.work == Work::Norm).unwrap();
        assert!(ops[norm].op.barrier);
        let after: Vec<&str> = names(&ops[norm + 1..]);
        assert_eq!(
            after,
            ["optim.g4", "optim.g3", "optim.g2", "optim.g1", "optim.g0"]
        );
        assert!(
            ops[..norm]
                .iter()
                .all(|s| !matches!(s.work, Work::Update { .. }))
        );
    }

    #[test]
    fn in_flight_micro_batches_run_block_by_block_with_late_updates_one_group_ahead() {
        let shape = StepShape {
            parts: 1,
            in_flight: 2,
            updates: Updates::NextStep,
            late: true,
            norm: true,
            commit: true,
            workspace_grads: true,
            ..shape()
        };
        let ops = build_step(&shape, &Toy);
        assert_eq!(
            names(&ops),
            [
                "optim.late.g0",
                "optim.late.g1",
                "m0.fwd.g0",
                "m1.fwd.g0",
                "optim.late.g2",
                "m0.fwd.g1",
                "m1.fwd.g1",
                "m0.fwd.g2",
                "m1.fwd.g2",
                "m0.head",
                "m1.head",
                "m0.bwd.g2",
                "m1.bwd.g2",
                "m0.bwd.g1",
                "m1.bwd.g1",
                "m0.bwd.g0",
                "m1.bwd.g0",
                "grad-norm",
                "commit",
            ]
        );
        // Without the head writing it, the micro-batches sum the
        // embedding's gradient in a workspace and the last one's embedding
        // backward writes the tensor, once.
        assert_eq!(ops[9].op.accesses, [read(0)]);
        assert_eq!(ops[15].op.accesses, []);
        assert_eq!(ops[16].op.accesses, [access(100, Mode::Write)]);
        // So is every block's: only the last micro-batch writes its tensor.
        let grad2 = access(102, Mode::Write);
        assert!(
            !ops[11].op.accesses.iter().any(|a| a.tensor == 102),
            "{:?}",
            ops[11].op
        );
        assert!(ops[12].op.accesses.contains(&grad2), "{:?}", ops[12].op);
    }

    #[test]
    #[should_panic(expected = "must divide")]
    fn in_flight_micro_batches_must_divide_the_step() {
        let shape = StepShape {
            in_flight: 3,
            micro_batches: 4,
            ..shape()
        };
        build_step(&shape, &Toy);
    }

    #[test]
    fn a_forward_only_pass_reads_each_groups_parameters_and_writes_nothing() {
        let ops = build_forward_only(2, 2, 2, &Toy);
        let mut expected = vec!["eval.m0.fwd.g0".to_string(), "eval.m1.fwd.g0".into()];
        for g in 1..5 {
            expected.extend((0..2).map(|m| format!("eval.m{m}.fwd.g{g}")));
        }
        expected.extend((0..2).map(|m| format!("eval.m{m}.loss")));
        assert_eq!(names(&ops), expected);
        for step_op in &ops {
            assert_eq!(step_op.op.accesses.len(), 1, "{:?}", step_op.op);
            assert_eq!(step_op.op.accesses[0].mode, Mode::Read);
            assert!(!matches!(
                step_op.work,
                Work::Forward { keep: true, .. }
                    | Work::Head { .. }
                    | Work::Backward { .. }
                    | Work::Update { .. }
            ));
        }
        let training = build_step(&shape(), &Toy);
        let fingerprint = |ops: &[StepOp]| crate::trace::op_fingerprint(&ops[0].op);
        assert_ne!(fingerprint(&ops), fingerprint(&training));
    }
}
