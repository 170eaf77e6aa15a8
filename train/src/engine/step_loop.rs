//! The step loop: where a step is (its number, the optimizer's, whether
//! its updates speculate, the last step's late update), and the order in
//! which the parts do a step's work. A parameter group's path through a
//! step reads top to bottom here: the schedule announces each op, the move
//! queue issues the plan's actions for it, the workspace computes on the
//! backend with the collective (gather, forward or backward, reduce), the
//! optimizer lane updates the group, and the decision keeps or redoes the
//! updates.

use std::time::Instant;

use strata_optim::{GradNorm, StepDecision, decide_step};
use strata_runtime::Tier;
use strata_scheduler::{Op, StepOp, Work};

use crate::error::{Result, TrainError};
use crate::model::OUTER;

use super::data::is_target;
use super::loss::Scalar;
use super::moves::Boundary;
use super::optimizer::Update;
use super::steps::{label, shape_index, shape_of};
use super::tensors::{grad_index, param_index, processor_tier, saved_index};
use super::{Engine, StepReport};

/// Where the run is: steps taken, optimizer steps, how the next step's
/// updates run, and whether a step failed part way.
pub(super) struct StepState {
    step: u64,
    /// Optimizer steps taken (skipped steps do not count).
    optimizer_steps: u64,
    /// Whether this step's updates start during backward, before the norm
    /// is known (the last step was not clipped).
    speculate: bool,
    /// The coefficients of the last step's update when it is late (runs in
    /// this step's forward).
    late: Option<Update>,
    /// The step that failed part way, after which the state is no step's:
    /// every later call is refused ([`TrainError::EngineFailed`]).
    failed: Option<u64>,
}

impl StepState {
    /// A run before its first step; its updates speculate from the start
    /// when `speculate`.
    pub(super) fn new(speculate: bool) -> StepState {
        StepState {
            step: 0,
            optimizer_steps: 0,
            speculate,
            late: None,
            failed: None,
        }
    }

    /// Steps run so far.
    pub(super) fn steps(&self) -> u64 {
        self.step
    }

    /// Optimizer steps taken so far.
    pub(super) fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    /// Whether the first step's updates speculate.
    pub(super) fn speculates(&self) -> bool {
        self.speculate
    }

    /// Refuses to go on after a step that failed part way: its counters,
    /// its state sets and the CPU thread's updates are no step's.
    pub(super) fn usable(&self) -> Result<()> {
        match self.failed {
            Some(step) => Err(TrainError::EngineFailed { step }),
            None => Ok(()),
        }
    }

    /// Marks the step running as failed part way.
    pub(super) fn fail(&mut self) {
        self.failed = Some(self.step);
    }

    /// Goes on from a checkpoint of `step`, `optimizer_steps` taken.
    pub(super) fn restore(&mut self, step: u64, optimizer_steps: u64) {
        self.step = step;
        self.optimizer_steps = optimizer_steps;
    }

    /// The last step's update, when it is late and yet to run.
    pub(super) fn take_late(&mut self) -> Option<Update> {
        self.late.take()
    }
}

impl Engine {
    /// [`Engine::step`]'s work.
    pub(super) fn run_step(&mut self, tokens: &[u32]) -> Result<StepReport> {
        if tokens.len() != self.env.tokens_per_step() {
            return Err(TrainError::Config {
                key: "train.micro_batch",
                value: self.env.config().train.micro_batch.to_string(),
                fix: format!(
                    "Engine::step was given {} tokens, and one step of this rank takes {} (grad_accumulation x micro_batch x (seq + 1)): pass Engine::tokens_per_step() of them",
                    tokens.len(),
                    self.env.tokens_per_step()
                ),
            });
        }
        let started = Instant::now();
        self.ws.forget_gathered();
        self.state.step += 1;
        let step = self.state.step;
        let lr = self.env.config().train.lr_at(step);
        let per_row = self.loss_weight(step, tokens)?;
        let loss_scale = self.loss.begin_step(per_row);
        let shape = shape_index(
            self.moves.current(),
            self.state.speculate,
            self.state.late.is_some(),
        );
        let ops = self.schedule.take_ops(shape);
        let result = self.run_ops(&ops, tokens, lr, loss_scale);
        self.schedule.end_ops(ops);
        let decision = match result {
            Ok(decision) => decision,
            Err(err) => {
                self.lane.stop();
                return Err(err);
            }
        };
        let (skipped, clipped, grad_norm, clip) = match decision {
            StepDecision::Skip => (true, false, f64::NAN, 1.0),
            StepDecision::Step {
                grad_norm,
                clip_coefficient,
                ..
            } => (false, clip_coefficient < 1.0, grad_norm, clip_coefficient),
        };
        let (train, world) = (&self.env.config().train, self.env.world());
        let micro_batches = (train.grad_accumulation * world) as f64;
        let loss = self
            .loss
            .finish(step, skipped, train.loss_scale_dynamic, micro_batches)?;
        let late = self.state.late.is_some();
        if !skipped {
            self.state.optimizer_steps += 1;
            self.moves.flip();
        }
        // Speculate while steps are not clipped: a clipped step's
        // speculation is thrown away and its update done late.
        if self.lane.overlapped() && !skipped {
            self.state.speculate = !clipped;
        }
        let seq = self.env.model().seq();
        Ok(StepReport {
            step,
            loss,
            lr,
            grad_norm,
            clip,
            skipped,
            late,
            loss_scale,
            tokens: (tokens.len() / (seq + 1) * seq * world) as u64,
            seconds: started.elapsed().as_secs_f64(),
            optimizer_wait_s: self.lane.take_wait_s(),
            optimizer_params_per_s: self.lane.take_rate(),
            eval_loss: None,
        })
    }

    /// With loss masks in the step's tokens (on any rank), the weight of
    /// each micro-batch's mean: its rows over the targets the step counts
    /// on every rank, so that the loss is the mean over those (as
    /// transformers' over labels other than -100 in one batch), whatever
    /// the micro-batches and ranks. None when every target counts: the
    /// mean of the micro-batches' means, the same number.
    fn loss_weight(&self, step: u64, tokens: &[u32]) -> Result<Option<f64>> {
        let seq = self.env.model().seq();
        let rows = (self.env.config().train.micro_batch * seq) as f64;
        let targets = tokens.len() / (seq + 1) * seq;
        let mut counts = [
            count_targets(tokens, seq) as f64,
            (targets * self.env.world()) as f64,
        ];
        if self.env.world() > 1 {
            self.env.collective().all_reduce_scalars(&mut counts[..1])?;
        }
        let [counted, all] = counts;
        if counted == all {
            return Ok(None);
        }
        if counted == 0.0 && self.env.rank() == 0 {
            tracing::warn!(
                "step {step} has no loss target (every target of its {all} is masked): its gradient is zero and its loss 0"
            );
        }
        Ok(Some(if counted == 0.0 { 0.0 } else { rows / counted }))
    }

    /// Runs the ops of one step and returns the decision; keeps the update
    /// to run in the next step when it must be late.
    fn run_ops(
        &mut self,
        ops: &[StepOp],
        tokens: &[u32],
        lr: f64,
        loss_scale: f32,
    ) -> Result<StepDecision> {
        let adam = self.env.config().train.adam(lr);
        let no_decay = strata_optim::AdamConfig {
            weight_decay: 0.0,
            ..adam
        };
        let next = self.state.optimizer_steps + 1;
        let coefficients = |grad_scale: f32| -> Result<Update> {
            Ok(Update {
                coefficients: [
                    no_decay.coefficients(next, grad_scale)?,
                    adam.coefficients(next, grad_scale)?,
                ],
                adam_step: next,
            })
        };
        let speculative = coefficients(1.0 / loss_scale)?;
        let late = self.state.late.take();
        self.schedule.begin_step(&ops[0].op);
        self.issue_actions(false)?;
        self.issue_actions(true)?;
        let mut decision = StepDecision::Skip;
        for step_op in ops {
            match step_op.work {
                Work::Norm => decision = self.decide(step_op, loss_scale)?,
                Work::Update { late: true, .. } => {
                    let update = late.expect("a late shape has the last step's update");
                    self.run_op(step_op, tokens, &update)?;
                }
                _ => self.run_op(step_op, tokens, &speculative)?,
            }
        }
        self.end_step()?;
        if let StepDecision::Step {
            grad_scale,
            clip_coefficient,
            ..
        } = decision
        {
            let (_, speculated, _) = shape_of(self.schedule.shape());
            if !speculated || clip_coefficient < 1.0 {
                self.state.late = Some(coefficients(grad_scale)?);
            }
        }
        Ok(decision)
    }

    /// Tells the tracker the op starts, issues the plan's next actions,
    /// and runs it.
    fn run_op(&mut self, step_op: &StepOp, tokens: &[u32], update: &Update) -> Result<()> {
        if let Work::Update { group: g, late } = step_op.work
            && self.lane.overlapped()
        {
            // Queued before the boundary's actions are issued, so that moves
            // of what it writes wait for it (else they carry stale bytes).
            // Its thread waits for its inputs' moves itself.
            self.update_group(g, late, processor_tier(step_op.op.processor), update)?;
            self.announce(&step_op.op)?;
            return self.issue_actions(true);
        }
        let started = Instant::now();
        let tier = self.begin_op(step_op)?;
        match step_op.work {
            Work::EmbedForward { m } => self.embed_forward(m, tokens)?,
            Work::Forward { m, layer, .. } => self.block_forward(m, layer)?,
            Work::Head { m } => self.head(m)?,
            Work::Backward { m, layer, .. } => self.block_backward(m, layer)?,
            Work::EmbedBackward { m } => self.embed_backward(m)?,
            Work::Update { group, late } => self.update_group(group, late, tier, update)?,
            Work::Norm => unreachable!("decided by Engine::decide"),
            Work::Loss { .. } => unreachable!("a forward-only pass's (Engine::evaluate)"),
            Work::Commit => self.wait_worker(None)?,
        }
        let (what, group, micro_batch) = label(step_op.work);
        self.env.runtime().record_compute(
            what,
            group as u32,
            micro_batch.map(|m| m as u32),
            started,
        );
        self.issue_actions(true)
    }

    /// Starts `step_op`: announced, the plan's actions issued, each tensor
    /// it reads or writes settled on the tier of its processor (returned).
    pub(super) fn begin_op(&mut self, step_op: &StepOp) -> Result<Tier> {
        self.announce(&step_op.op)?;
        let tier = processor_tier(step_op.op.processor);
        for access in &step_op.op.accesses {
            self.moves.settle_fetch(access.tensor as usize, tier)?;
        }
        Ok(tier)
    }

    /// Tells the schedule the op starts and issues the plan's actions for
    /// the boundary after it.
    pub(super) fn announce(&mut self, op: &Op) -> Result<()> {
        self.schedule.announce(op)?;
        self.issue_actions(false)
    }

    /// Retries the held actions, then issues this boundary's planned ones
    /// of one kind (`releases`: evictions and drops, after the op ran).
    pub(super) fn issue_actions(&mut self, releases: bool) -> Result<()> {
        self.retry_held()?;
        let at = Boundary {
            writing: self.lane.writing(),
            schedule: &self.schedule,
            step: self.state.step,
        };
        self.moves.issue_planned(&self.env, releases, &at)
    }

    /// Issues the held actions again, with the lane's finished updates
    /// booked first (those still waiting are held again).
    fn retry_held(&mut self) -> Result<()> {
        if !self.moves.has_held() {
            return Ok(());
        }
        self.lane.poll(self.env.groups());
        let at = Boundary {
            writing: self.lane.writing(),
            schedule: &self.schedule,
            step: self.state.step,
        };
        self.moves.retry_held(&self.env, &at)
    }

    /// Starts (on the CPU thread) or runs group `g`'s update from one set
    /// into the other, on `tier`.
    fn update_group(&mut self, g: usize, late: bool, tier: Tier, update: &Update) -> Result<()> {
        let job = self.moves.update_job(&self.env, g, late, tier, update);
        self.lane.submit(&self.env, job)
    }

    /// Waits until the CPU thread has no update of group `g` (every group
    /// with None) outstanding; returns the first error it reported.
    fn wait_worker(&mut self, g: Option<usize>) -> Result<()> {
        let started = Instant::now();
        let mut waited = false;
        while self.lane.busy(g) {
            waited = true;
            self.lane.book_next(self.env.groups())?;
            // The moves held for this update go now, not at the next
            // boundary: a long wait (the commit's) would otherwise keep
            // every finished update's inputs and outputs on the host.
            self.retry_held()?;
        }
        if waited {
            self.lane.waited(started);
            // (A commit's wait is its whole span already.)
            if let Some(g) = g {
                self.env
                    .runtime()
                    .record_compute("wait for optimizer", g as u32, None, started);
            }
        }
        self.lane.take_error()
    }

    /// The barrier: every update is in, the global norm and the overflow
    /// check decide what happens to them.
    fn decide(&mut self, step_op: &StepOp, loss_scale: f32) -> Result<StepDecision> {
        self.announce(&step_op.op)?;
        let sum_squares = self
            .loss
            .reduce(self.env.collective(), self.env.replica() == 0)?;
        self.issue_actions(true)?;
        let clip = self.env.config().train.clip_norm;
        Ok(decide_step(
            GradNorm { sum_squares },
            loss_scale,
            (clip > 0.0).then_some(clip),
        ))
    }

    /// Group `g`'s current bf16 shards gathered into the workspace, once no
    /// late update of the group is still writing them.
    pub(super) fn gather(&mut self, g: usize) -> Result<()> {
        self.wait_worker(Some(g))?;
        let shard = self.moves.id(param_index(g, self.moves.current()));
        self.ws.gather(&self.env, g, shard)
    }

    /// The embeddings' forward of micro-batch `m`.
    fn embed_forward(&mut self, m: usize, tokens: &[u32]) -> Result<()> {
        self.gather(OUTER)?;
        self.ws.embed_forward(&self.env, m, tokens)
    }

    /// Block `b`'s forward of micro-batch `m`; keeps what its backward
    /// needs (its input when it recomputes, else all its activations).
    fn block_forward(&mut self, m: usize, b: usize) -> Result<()> {
        self.gather(b + 1)?;
        self.ws.block_forward(&self.env, m, b)?;
        let id = self
            .moves
            .tensor_to_write(&self.env, self.saved_index(m, b))?;
        self.ws.save(&self.env, id, self.schedule.recomputes(b))
    }

    /// The head's forward and backward of micro-batch `m` (the first also
    /// issues the deferred write-backs); its loss is read at the barrier.
    fn head(&mut self, m: usize) -> Result<()> {
        if m == 0 {
            self.moves.write_back_deferred(&self.env)?;
        }
        self.gather(OUTER)?;
        let train = &self.env.config().train;
        let scale = self
            .loss
            .head_scale(train.grad_accumulation * self.env.world());
        let loss = self.ws.head(&self.env, m, scale)?;
        self.loss.defer(Scalar::Loss, loss)
    }

    /// Block `b`'s backward of micro-batch `m`; after the last micro-batch
    /// its gradient is reduced.
    fn block_backward(&mut self, m: usize, b: usize) -> Result<()> {
        self.gather(b + 1)?;
        let saved = self.moves.id(self.saved_index(m, b));
        let recomputes = self.schedule.recomputes(b);
        self.ws.block_backward(&self.env, m, b, saved, recomputes)?;
        if m + 1 == self.env.config().train.grad_accumulation {
            self.reduce_gradient(b + 1)?;
        }
        Ok(())
    }

    /// The embeddings' backward of micro-batch `m`; after the last, the
    /// outer group's gradient the step's micro-batches summed is reduced.
    fn embed_backward(&mut self, m: usize) -> Result<()> {
        self.ws.embed_backward(&self.env, m)?;
        if m + 1 == self.env.config().train.grad_accumulation {
            self.reduce_gradient(OUTER)?;
        }
        Ok(())
    }

    /// Reduce-scatters group `g`'s gradient into its shard's tensor; its
    /// sum of squares is read at the barrier.
    fn reduce_gradient(&mut self, g: usize) -> Result<()> {
        let index = grad_index(g);
        let id = self.moves.tensor_to_write(&self.env, index)?;
        let dtype = self.moves.dtype(index);
        let norm = self.ws.reduce_gradient(&self.env, g, id, dtype)?;
        self.loss.defer(Scalar::Norm(g), norm)
    }

    fn saved_index(&self, m: usize, b: usize) -> usize {
        saved_index(self.env.groups().len(), self.env.model().layers(), m, b)
    }

    /// Applies the last step's update now if it is late (else it runs
    /// during the next step's forward), so that the current set holds the
    /// updated model.
    pub(super) fn apply_late(&mut self) -> Result<()> {
        let Some(update) = self.state.take_late() else {
            return Ok(());
        };
        self.ws.forget_gathered();
        let tier = self.env.config().placement.optimizer_tier();
        for g in 0..self.env.groups().len() {
            self.update_group(g, true, tier, &update)?;
        }
        self.wait_worker(None)?;
        self.moves.return_home(&self.env)
    }

    /// Ends the step: waits for moves in flight, frees the step's own
    /// tensors, puts every persistent one back home alone, closes the trace.
    pub(super) fn end_step(&mut self) -> Result<()> {
        self.moves.return_home(&self.env)?;
        self.schedule.end_step()
    }
}

/// The targets of `tokens` (sequences of `seq + 1`: each one's last `seq`)
/// that a loss counts ([`is_target`]).
pub(super) fn count_targets(tokens: &[u32], seq: usize) -> usize {
    tokens
        .chunks_exact(seq + 1)
        .map(|s| s[1..].iter().filter(|&&t| is_target(t)).count())
        .sum()
}
