//! The training engine: one data-parallel rank of a ZeRO-3 run of a model
//! (any architecture behind [`crate::model::Model`]) whose parameters,
//! gradients, optimizer states and activations live in the runtime's tiers
//! and move under the scheduler's plans.
//!
//! Every group of parameters (the embeddings, then each block) is cut into
//! one shard per rank. A step: gather the embeddings, run each block's
//! forward (all-gather its bf16 shards, keep its input when it
//! recomputes, else all its activations), the head and loss, then each
//! block's backward (recompute from the kept input where it does,
//! reduce-scatter the gradients into this rank's fp32 gradient shard).
//! Which blocks recompute is `train.checkpoint_activations`: every one,
//! none, or what `activations.rs` picks. Every micro-batch of the step is
//! in flight at once and each op runs for all of them in turn, so a
//! block's parameters are fetched once per pass and its gradient is summed
//! while it is on the device. The sums are the same whatever recomputes. Updates write the new
//! master weights, moments and bf16 copy into a second set of tensors, so
//! the first stays whole until the global norm decides, and run on the CPU
//! thread overlapped with compute in one of two ways:
//! - speculative: when the last step was not clipped, a group's update
//!   starts as soon as its gradient shard is final, while backward goes
//!   on. If the norm then says no clipping, it is kept.
//! - late: when the last step was clipped (or a speculation turns out to
//!   be), the update, with the clip coefficient, runs during the next
//!   step's forward, each group's queued one group ahead of the block that
//!   reads it, so that it overlaps the block before.
//!
//! An overflow skips the update. Either way each update is the one exact
//! clipped step: never stale, never partial.
//!
//! With optimizer states on NVMe, the state cache (`placement.state_cache`)
//! keeps the host copies of the first groups' states that a late update
//! wrote until the next step's late update reads them: those updates, the
//! first of the step, then wait for no drive read, and the drive reads the
//! later groups' states meanwhile. Their write-backs wait until the late
//! updates are done. The cache's bytes are taken from the plans' host room.
//!
//! The engine knows its step's ops before it runs, so it plans each shape
//! of step up front ([`StepTracker::prime`]): the plan's peaks are the
//! prediction, a placement that cannot fit fails before training, and
//! step 1 already prefetches.
//!
//! The engine's parts, one concern each: `steps` assembles
//! each shape of step's ops; `tensors` lays out the groups, shards and
//! slots and how the planner sees them; `moves` is the move queue (the
//! plan's actions, held and retried); `compute` runs one op on the backend
//! and the collective; `optimizer` is the CPU optimizer lane and the
//! step's decision; `checkpoint` writes and resumes; `run` drives whole
//! runs over ranks; this module holds the `Engine` and its step loop.

mod activations;
mod checkpoint;
mod compute;
mod config;
mod data;
pub mod deepspeed;
mod durable;
mod moves;
mod optimizer;
mod ownership;
mod run;
mod steps;
mod stop;
mod tensors;

pub use checkpoint::{Checkpoint, CheckpointMeta, ROUNDING_STOCHASTIC};
pub use config::{
    COS_MIN_RATIO_DEFAULT, Checkpointing, ComputeDtype, GRAD_ACCUMULATION_MAX, ModelConfig,
    OptimConfig, Placement, PlacementConfig, RANKS_MAX, Schedule, StateCache, StateDtype,
    TrainConfig, TrainSettings, WARMUP_NUM_STEPS_DEFAULT, WarmupType,
};
pub use data::{ByteCorpus, Corpus, TokenDtype, window_start};
pub use deepspeed::{DeepSpeedMapping, from_deepspeed_json};
pub use run::{CheckpointFailure, Progress, RunOptions, RunSummary, TierBytes, run};
pub use stop::StopRequest;

use std::sync::Arc;
use std::time::Instant;

use strata_optim::{LossScaler, StepDecision};
use strata_scheduler as sched;
use strata_scheduler::{Action, Follow, StepOp, StepTracker, Work};
use strata_storage::ByteSize;

use strata_comm::Collective;
use strata_kernels::{Backend, CpuBackend};
use strata_runtime::{Runtime, Tier};

use crate::error::{Result, TrainError, bad, os};
use crate::model::{self, Model};
use compute::Workspace;
use optimizer::{CpuWorker, PoolSpread, Update, optimizer_pool};
use steps::{estimated_block_ns, shape_index, shape_of};
use tensors::{Group, Slot, groups, links, optimizer_tier, slots, specs, state_cache};

/// Trace tensors per parameter group: two bf16 parameter shards, two
/// optimizer-state shards (current and next), one gradient shard.
const PER_GROUP: usize = 5;
/// Shapes of step: current set (0 or 1) x speculative updates (or not) x
/// late updates from the step before (or not).
const SHAPES: usize = 8;
/// Plans kept: one per shape.
const PLANS_MAX: usize = SHAPES;

/// One step's outcome on this rank (values are global: all-reduced).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StepReport {
    /// The step, from 1.
    pub step: u64,
    /// Mean loss over every rank's tokens.
    pub loss: f64,
    /// The learning rate used.
    pub lr: f64,
    /// Global gradient norm (unscaled); NaN when the step was skipped.
    pub grad_norm: f64,
    /// The clip coefficient applied (1: not clipped).
    pub clip: f32,
    /// A gradient overflowed: the update was skipped and the loss scale
    /// backed off.
    pub skipped: bool,
    /// The update is late: it runs during the next step's forward (the
    /// step was clipped, so it could not be done speculatively).
    pub late: bool,
    /// The loss scale the step used.
    pub loss_scale: f32,
    /// Tokens over all ranks.
    pub tokens: u64,
    /// Wall time of the step.
    pub seconds: f64,
    /// Of which compute waited for the CPU optimizer thread (late updates
    /// before a block's forward, the commit).
    pub optimizer_wait_s: f64,
    /// The optimizer lane's rate over the updates it finished during the
    /// step: parameters per second of its busy time, each update's from
    /// when its inputs were at hand (0: none finished).
    pub optimizer_params_per_s: f64,
}

/// What the plans predict per tier for this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Prediction {
    /// Peak bytes per tier ([`Tier::ALL`] order), device including the
    /// workspace.
    pub peak_bytes: [u64; 3],
    /// The device bytes held for compute buffers.
    pub workspace_bytes: u64,
    /// The host bytes held for the state cache (in the host peak).
    pub state_cache_bytes: u64,
    /// Blocks that recompute their forward in backward.
    pub recomputed_blocks: usize,
}

/// One rank of a training run. Build it with [`Engine::new`], then call
/// [`Engine::step`] with this rank's tokens for each step.
pub struct Engine {
    config: TrainConfig,
    /// The architecture and its shape.
    model: Arc<dyn Model>,
    runtime: Arc<Runtime>,
    /// Where the model computes.
    backend: Box<dyn Backend>,
    collective: Box<dyn Collective>,
    tracker: StepTracker,
    groups: Arc<Vec<Group>>,
    slots: Vec<Slot>,
    /// Per block, whether its backward recomputes its forward
    /// (`train.checkpoint_activations`).
    recompute: Vec<bool>,
    /// What the plans take one block's forward of one micro-batch to cost:
    /// measured when the activations' choice measured it, else estimated.
    block_ns: u64,
    /// The links the plans are costed with (host <-> device measured with
    /// the block's forward).
    links: sched::Links,
    /// The ops of each shape of step, by [`shape_index`].
    shapes: Vec<Vec<StepOp>>,
    /// Which of the two parameter/state sets is current.
    current: usize,
    ws: Workspace,
    /// The optimizer's pool when it runs inline (states on the device).
    inline: strata_optim::Pool,
    /// The inline optimizer's rate since the last step report.
    inline_rate: optimizer::LaneRate,
    worker: Option<CpuWorker>,
    scaler: LossScaler,
    /// Optimizer steps taken (skipped steps do not count).
    optimizer_steps: u64,
    /// The coefficients of the last step's update when it is late (runs
    /// in this step's forward).
    late: Option<Update>,
    /// Whether this step's updates start during backward, before the
    /// norm is known (the last step was not clipped).
    speculate: bool,
    step: u64,
    sum_squares: Vec<f64>,
    actions: Vec<Action>,
    /// Planned actions that wait: on a tensor the CPU thread uses or has
    /// yet to write (a move before would carry stale bytes), or one with a
    /// move in flight. Retried at every boundary.
    held: Vec<Action>,
    /// `held` as it was when a retry began (its own buffer: no allocation).
    retry: Vec<Action>,
    /// Per trace index, queued updates that write the tensor.
    writing: Vec<u32>,
    /// Nanoseconds compute waited for the CPU thread this step.
    optimizer_wait_ns: u64,
    /// The first error the CPU thread reported, not yet returned.
    worker_error: Option<TrainError>,
    /// Ops announced so far in this step (the op running is
    /// `position - 1`).
    position: usize,
    /// The shape of the step running ([`shape_index`]).
    shape: usize,
    /// Per shape, the position after which each tensor is no longer used.
    last_use: Vec<Vec<usize>>,
    prediction: Prediction,
    loss_sum: f64,
    /// Losses and gradient norms computed on the device and not read yet:
    /// read at the step's barrier (the oldest sooner, past
    /// [`compute::SCALARS_PENDING_MAX`]), so the host does not wait for the
    /// device after every micro-batch.
    scalars: std::collections::VecDeque<(compute::Scalar, strata_kernels::Readback)>,
    /// Write-backs of fresh cached states, issued once the late updates
    /// are done (the drive reads the other states first).
    deferred: Vec<usize>,
    /// Groups `0..cache_groups` have their states in the state cache.
    cache_groups: usize,
    /// The step that failed part way, after which the state is no step's:
    /// every later call is refused ([`TrainError::EngineFailed`]).
    failed: Option<u64>,
}

impl Engine {
    /// Builds rank `collective.rank()`: opens its runtime, registers and
    /// initializes its shards (the same values whatever the number of
    /// ranks), plans every shape of step and fails if one does not fit.
    pub fn new(config: &TrainConfig, collective: Box<dyn Collective>) -> Result<Engine> {
        Self::with_faults(config, collective, None)
    }

    /// [`Engine::new`] with its NVMe store's I/O run through a seeded fault
    /// injector ([`Faults`]), for simulations.
    pub fn with_faults(
        config: &TrainConfig,
        collective: Box<dyn Collective>,
        faults: Option<Faults>,
    ) -> Result<Engine> {
        let started = Instant::now();
        config.validate()?;
        let (world, rank) = (collective.world(), collective.rank());
        if world != config.train.ranks {
            return Err(bad(
                "train.ranks",
                config.train.ranks.to_string(),
                format!("the collective group has {world} ranks: make them agree"),
            ));
        }
        let model: Arc<dyn Model> = model::build(&config.model)?.into();
        let groups = Arc::new(groups(&*model, world, rank));
        let batch = config.train.micro_batch;
        // `auto`: the GPU if one answers and its backend opens (a driver
        // alone, an architecture strata does not compile for or a missing
        // library leave the CPU device), said once.
        let auto = config.device.kind == strata_runtime::DeviceChoice::Auto;
        let (mut resolved, mut why_not_gpu) = config.with_device_resolved();
        let (backend, context, backend_bytes) = match open_backend(&resolved, batch * model.seq()) {
            Err(err) if auto && resolved.device.kind == strata_runtime::DeviceChoice::Cuda => {
                why_not_gpu = Some(err.to_string());
                resolved.device.kind = strata_runtime::DeviceChoice::Cpu;
                open_backend(&resolved, batch * model.seq())?
            }
            opened => opened?,
        };
        if rank == 0 && auto {
            match &why_not_gpu {
                None => tracing::info!("device.kind = auto: training on the GPU"),
                Some(why) => {
                    tracing::info!("device.kind = auto: training on the CPU device ({why})")
                }
            }
        }
        let config = &resolved;
        let compute_dtype = config.train.compute_dtype.resolve(backend.kind());
        let mut ws = Workspace::new(
            &*backend,
            &*model,
            batch,
            &groups,
            world,
            config.train.in_flight(),
            compute_dtype,
        )?;
        let workspace_bytes = ws.bytes() + backend_bytes;
        let compute_ready = started.elapsed();
        // Before the runtime: its threads commit the pinned pool they update.
        let pool = match config.placement.optimizer {
            Placement::Device => None,
            _ => Some(optimizer_pool(config.optim.threads, world)?),
        };
        let spread = pool.as_ref().map(PoolSpread);
        let spread = spread.as_ref().map(|s| s as &dyn strata_runtime::Spread);
        let runtime = open_runtime(config, rank, workspace_bytes, faults, context, spread)?;
        let runtime_ready = started.elapsed();
        let kept = activations::kept_bytes(&ws.buffers);
        // The rooms the activations may use: the plan's tiers less the
        // model states (measured with the smallest activations, so that
        // the host's staging reserve is not sized for the largest).
        let every = slots(config, &groups, kept, &vec![true; model.layers()]);
        let rooms = plan_config(config, &runtime, &every, groups.len(), links())?.0;
        let candidates = activations::recompute_blocks(
            config,
            &*model,
            &runtime,
            &*backend,
            &mut ws,
            &groups,
            &every,
            rooms.capacity_bytes,
        )?;
        // Measured rates, when the choice measured them, cost the plans.
        let (block_ns, links) = match candidates.rates {
            Some(rates) => (rates.block_forward_ns as u64, rates.links()),
            None => (estimated_block_ns(config, &*model), links()),
        };
        let layers = model.layers();
        let accumulation = config.train.grad_accumulation;
        let tensors = PER_GROUP * groups.len() + accumulation * layers;
        // An empty stand-in: `plan_shapes` makes the real one below.
        let tracker = StepTracker::new(rooms, 0, 0, 1);
        let mut engine = Engine {
            config: config.clone(),
            model,
            runtime: runtime.clone(),
            backend,
            collective,
            tracker,
            groups: groups.clone(),
            // Set by `plan_activations` below.
            slots: Vec::new(),
            recompute: Vec::new(),
            block_ns,
            links,
            shapes: Vec::with_capacity(SHAPES),
            current: 0,
            ws,
            inline: optimizer_pool(1, 1)?,
            inline_rate: optimizer::LaneRate::default(),
            worker: None,
            scaler: LossScaler::new(config.train.scaler())?,
            optimizer_steps: 0,
            late: None,
            speculate: config.placement.optimizer != Placement::Device,
            step: 0,
            sum_squares: vec![0.0; groups.len()],
            actions: Vec::with_capacity(1024),
            held: Vec::with_capacity(64),
            retry: Vec::with_capacity(64),
            writing: vec![0; tensors],
            worker_error: None,
            optimizer_wait_ns: 0,
            position: 0,
            shape: 0,
            last_use: Vec::with_capacity(SHAPES),
            prediction: Prediction {
                workspace_bytes,
                ..Prediction::default()
            },
            loss_sum: 0.0,
            scalars: std::collections::VecDeque::with_capacity(compute::SCALARS_PENDING_MAX),
            deferred: Vec::with_capacity(groups.len()),
            cache_groups: 0,
            failed: None,
        };
        engine.plan_activations(candidates.recompute, kept)?;
        engine.prediction.recomputed_blocks = engine.recompute.iter().filter(|&&r| r).count();
        let planned = started.elapsed();
        engine.initialize()?;
        if let Some(pool) = pool {
            // With the compute elsewhere (a GPU), the pool's cores wait for
            // nothing but the lane: it wakes them as each update arrives.
            let wake = engine.backend.kind() != strata_device::DeviceKind::Cpu
                && std::env::var_os("STRATA_LANE_WAKE").is_none_or(|v| v != "0");
            engine.worker = Some(CpuWorker::start(runtime, pool, groups, wake)?);
        }
        let ready = started.elapsed();
        // Start-up grows with the model (minutes at billions of
        // parameters): where it went.
        tracing::info!(
            "rank {rank} ready in {:.1} s: compute setup {:.1} s, runtime and pinned pool {:.1} s, \
             activation choice and plans {:.1} s, parameters initialized {:.1} s",
            ready.as_secs_f64(),
            compute_ready.as_secs_f64(),
            (runtime_ready - compute_ready).as_secs_f64(),
            (planned - runtime_ready).as_secs_f64(),
            (ready - planned).as_secs_f64(),
        );
        Ok(engine)
    }

    /// Plans every shape of step with the state cache of `cache_groups`
    /// groups, or without it when "auto" does not fit it (an explicit size
    /// that does not fit is named as the problem).
    fn plan_with_cache(
        &mut self,
        plan_config: &sched::PlanConfig,
        cache_groups: usize,
        cache_bytes: u64,
    ) -> Result<()> {
        match self.plan_shapes(plan_config, cache_groups, cache_bytes) {
            Err(TrainError::DoesNotFit { cause }) if cache_groups > 0 => {
                let mut full = plan_config.clone();
                full.capacity_bytes[Tier::Host.index()] += cache_bytes;
                self.plan_shapes(&full, 0, 0)?;
                if let StateCache::Bytes(bytes) = self.config.placement.state_cache {
                    return Err(bad(
                        "placement.state_cache",
                        ByteSize(bytes),
                        format!(
                            "the plans fit the host budget only without it ({cause}): lower it, or use \"auto\""
                        ),
                    ));
                }
                Ok(())
            }
            planned => planned,
        }
    }

    /// Lists and plans every shape of step with `config` (the host tier
    /// less the state cache of the first `cache_groups` groups'
    /// `cache_bytes`): their last uses, and the plans' peaks (the
    /// prediction).
    fn plan_shapes(
        &mut self,
        config: &sched::PlanConfig,
        cache_groups: usize,
        cache_bytes: u64,
    ) -> Result<()> {
        let tensors = specs(&self.runtime, &self.slots);
        let ops_max = 4 * tensors.len() + 16;
        self.tracker = StepTracker::new(config.clone(), tensors.len(), ops_max, PLANS_MAX);
        for spec in &tensors {
            self.tracker.tensor(spec.clone())?;
        }
        self.cache_groups = cache_groups;
        self.shapes.clear();
        self.last_use.clear();
        let mut peak = [0u64; 3];
        for shape in 0..SHAPES {
            let (current, speculate, late) = shape_of(shape);
            let ops = self.step_ops(current, speculate, late);
            let mut last = vec![0; self.slots.len()];
            for (k, step_op) in ops.iter().enumerate() {
                for access in &step_op.op.accesses {
                    last[access.tensor as usize] = last[access.tensor as usize].max(k + 1);
                }
            }
            let trace = sched::Trace {
                tensors: tensors.clone(),
                ops: ops.iter().map(|s| s.op.clone()).collect(),
            };
            let plan = self.tracker.prime(&trace)?;
            let footprint = |t: usize, tier: sched::Tier| {
                self.runtime.footprint_bytes(self.slots[t].meta.len_bytes())[tier.index()]
            };
            let replayed = sched::replay_peak_bytes(&trace, plan, &footprint)
                .expect("the planner's plans replay");
            for (p, planned) in peak.iter_mut().zip(replayed) {
                *p = (*p).max(planned);
            }
            self.shapes.push(ops);
            self.last_use.push(last);
        }
        peak[Tier::Device.index()] += self.prediction.workspace_bytes;
        peak[Tier::Host.index()] += cache_bytes;
        self.prediction.peak_bytes = peak;
        self.prediction.state_cache_bytes = cache_bytes;
        Ok(())
    }

    /// The runtime of this rank (stats, trace).
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// What the plans predict.
    pub fn prediction(&self) -> Prediction {
        self.prediction
    }

    /// Steps run so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Bytes of model states this rank holds: bf16 parameters, fp32
    /// gradients, master weights and two moments in `optim.state_dtype`
    /// (one set; the second set the overlapped update writes into is
    /// counted in the tier peaks).
    pub fn model_state_bytes(&self) -> u64 {
        let states = self.config.optim.state_dtype.bytes_per_param() as u64;
        self.groups
            .iter()
            .map(|g| (2 + 4 + states) * g.shard as u64)
            .sum()
    }

    /// Tokens one call of [`Engine::step`] takes from this rank:
    /// `grad_accumulation x micro_batch` sequences of `seq + 1` tokens
    /// (inputs and the next-token targets).
    pub fn tokens_per_step(&self) -> usize {
        self.config.train.grad_accumulation * self.config.train.micro_batch * (self.model.seq() + 1)
    }

    /// Runs one step on this rank's `tokens` ([`Engine::tokens_per_step`]
    /// of them). Every rank calls it together, with its own tokens. A step
    /// that fails once begun leaves the engine refusing further calls.
    pub fn step(&mut self, tokens: &[u32]) -> Result<StepReport> {
        self.usable()?;
        let before = self.step;
        let report = self.run_step(tokens);
        if report.is_err() && self.step != before {
            self.failed = Some(self.step);
        }
        report
    }

    /// Refuses to go on after a step that failed part way: its counters,
    /// its state sets and the CPU thread's updates are no step's.
    pub(super) fn usable(&self) -> Result<()> {
        match self.failed {
            Some(step) => Err(TrainError::EngineFailed { step }),
            None => Ok(()),
        }
    }

    /// [`Engine::step`]'s work.
    fn run_step(&mut self, tokens: &[u32]) -> Result<StepReport> {
        if tokens.len() != self.tokens_per_step() {
            return Err(TrainError::Config {
                key: "train.micro_batch",
                value: self.config.train.micro_batch.to_string(),
                fix: format!(
                    "Engine::step was given {} tokens, and one step of this rank takes {} (grad_accumulation x micro_batch x (seq + 1)): pass Engine::tokens_per_step() of them",
                    tokens.len(),
                    self.tokens_per_step()
                ),
            });
        }
        let started = Instant::now();
        self.step += 1;
        let step = self.step;
        let lr = self.config.train.lr_at(step);
        let loss_scale = self.scaler.scale();
        self.loss_sum = 0.0;
        self.sum_squares.fill(0.0);
        // Left by a step that failed part way: nothing will read them.
        self.scalars.clear();
        self.shape = shape_index(self.current, self.speculate, self.late.is_some());
        let ops = std::mem::take(&mut self.shapes[self.shape]);
        let result = self.run_ops(&ops, tokens, lr, loss_scale);
        self.shapes[self.shape] = ops;
        let decision = match result {
            Ok(decision) => decision,
            Err(err) => {
                // Whatever the CPU thread still holds is dropped with it.
                self.worker = None;
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
        let world = self.collective.world();
        let micro_batches = (self.config.train.grad_accumulation * world) as f64;
        let loss = self.loss_sum / micro_batches;
        // A dynamic scale that overflows at its floor cannot go lower: the
        // gradients are not finite at any scale (a static one skips on).
        if skipped && self.config.train.loss_scale_dynamic && self.scaler.at_floor() {
            return Err(TrainError::Diverged {
                step,
                loss_scale,
                loss,
            });
        }
        self.scaler.update(skipped);
        let late = self.late.is_some();
        if !skipped {
            self.optimizer_steps += 1;
            self.current = 1 - self.current;
        }
        // Speculate while steps are not clipped: a clipped step's
        // speculation is thrown away and its update done late.
        if self.worker.is_some() && !skipped {
            self.speculate = !clipped;
        }
        Ok(StepReport {
            step,
            loss,
            lr,
            grad_norm,
            clip,
            skipped,
            late,
            loss_scale,
            tokens: (tokens.len() / (self.model.seq() + 1) * self.model.seq() * world) as u64,
            seconds: started.elapsed().as_secs_f64(),
            optimizer_wait_s: std::mem::take(&mut self.optimizer_wait_ns) as f64 / 1e9,
            optimizer_params_per_s: match &mut self.worker {
                Some(worker) => worker.lane.take(),
                None => self.inline_rate.take(),
            },
        })
    }

    /// Runs the ops of one step and returns the decision; sets
    /// [`Engine::late`] when the update must run in the next step.
    fn run_ops(
        &mut self,
        ops: &[StepOp],
        tokens: &[u32],
        lr: f64,
        loss_scale: f32,
    ) -> Result<StepDecision> {
        let adam = self.config.train.adam(lr);
        let no_decay = strata_optim::AdamConfig {
            weight_decay: 0.0,
            ..adam
        };
        let next = self.optimizer_steps + 1;
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
        let late = self.late.take();
        self.position = 0;
        self.actions.clear();
        if let Follow::Plan(actions) = self.tracker.begin_step_with(&ops[0].op) {
            self.actions.extend_from_slice(actions);
        }
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
            let (_, speculated, _) = shape_of(self.shape);
            if !speculated || clip_coefficient < 1.0 {
                self.late = Some(coefficients(grad_scale)?);
            }
        }
        Ok(decision)
    }

    /// Every rank's outcome of a part each did: this rank's error, or one
    /// naming the rank that failed (the outer error: the collective
    /// itself failed).
    fn agree(&self, outcome: Result<()>) -> Result<Result<()>> {
        let world = self.collective.world();
        let rank = self.collective.rank();
        let mut failed = vec![0.0f64; world.min(strata_comm::SCALARS_MAX)];
        if outcome.is_err() {
            let slot = rank.min(failed.len() - 1);
            failed[slot] = 1.0;
        }
        self.collective.all_reduce_scalars(&mut failed)?;
        if outcome.is_err() {
            return Ok(outcome);
        }
        Ok(match failed.iter().position(|&f| f > 0.0) {
            Some(other) => Err(TrainError::Rank {
                rank: other,
                cause: "it could not write its part of the checkpoint".into(),
            }),
            None => Ok(()),
        })
    }

    /// Whether any rank says `flag`; every rank calls it together.
    fn any_rank(&self, flag: bool) -> Result<bool> {
        let mut any = [f64::from(u8::from(flag))];
        self.collective.all_reduce_scalars(&mut any)?;
        Ok(any[0] > 0.0)
    }

    /// Applies the last step's update now if it is late (else it runs
    /// during the next step's forward), so that the current set holds the
    /// updated model. [`Engine::save_checkpoint`] calls it; call it before
    /// reading the weights some other way. Every rank calls it together.
    pub fn flush(&mut self) -> Result<()> {
        self.usable()?;
        let Some(update) = self.late.take() else {
            return Ok(());
        };
        let tier = optimizer_tier(self.config.placement.optimizer);
        for g in 0..self.groups.len() {
            self.update_group(g, true, tier, &update)?;
        }
        self.wait_worker(None)?;
        self.return_home()
    }

    /// Ends the step: waits for moves in flight, frees the step's own
    /// tensors, puts every persistent one back home alone, closes the trace.
    fn end_step(&mut self) -> Result<()> {
        self.return_home()?;
        self.tracker.end_step()?;
        Ok(())
    }
}

/// A compute backend, the GPU context it computes on (none on the CPU
/// device), and the device bytes it holds.
type Opened = (
    Box<dyn Backend>,
    Option<Arc<strata_device::cuda::Context>>,
    u64,
);

/// The compute backend `config.device.kind` names (resolved: `cuda` or
/// `cpu`) for micro-batches of `tokens` tokens; on a GPU on a context the
/// runtime's device will share (one compute stream, the copy streams
/// ordered by its events).
fn open_backend(config: &TrainConfig, tokens: usize) -> Result<Opened> {
    match config.device.kind {
        strata_runtime::DeviceChoice::Cuda => {
            let context = strata_device::cuda::Context::open(config.device.ordinal)?;
            let limits = strata_kernels::cuda::CudaLimits {
                rows_max: tokens,
                upload_bytes_max: tokens * 4,
            };
            let backend = strata_kernels::cuda::CudaBackend::new(context.clone(), limits)?;
            Ok((Box::new(backend), Some(context), limits.device_bytes()))
        }
        strata_runtime::DeviceChoice::Cpu | strata_runtime::DeviceChoice::Auto => {
            Ok((Box::new(CpuBackend), None, 0))
        }
    }
}

/// Creates the NVMe directories of rank `rank` and opens its runtime.
fn open_runtime(
    config: &TrainConfig,
    rank: usize,
    workspace_bytes: u64,
    faults: Option<Faults>,
    context: Option<Arc<strata_device::cuda::Context>>,
    spread: Option<&dyn strata_runtime::Spread>,
) -> Result<Arc<Runtime>> {
    let runtime_config = config.rank_runtime(rank, workspace_bytes)?;
    if let Some(nvme) = &runtime_config.nvme {
        for dir in &nvme.dirs {
            std::fs::create_dir_all(dir).map_err(|err| {
                os(
                    format!("create nvme.dirs entry {}", dir.display()),
                    err,
                    "choose a writable directory in nvme.dirs",
                )
            })?;
        }
    }
    // Each rank's faults are its own, and the same on every replay.
    let seeded = faults.map(|f| (f, f.seed ^ rank as u64));
    let storage = seeded.map(|(f, seed)| (f.rates, seed));
    // The backend's context, if any: the arena on its GPU, its streams.
    let device = match context {
        Some(context) => Some(Box::new(strata_runtime::CudaDevice::on_context(
            context,
            runtime_config.device.budget.0,
        )?) as Box<dyn strata_runtime::Device>),
        None => None,
    };
    let runtime = Runtime::open_with(&runtime_config, device, storage, spread)?;
    if let Some((faults, seed)) = seeded {
        runtime.inject_memory_faults(strata_runtime::MemoryFaults {
            rate: faults.oom,
            seed,
        });
    }
    Ok(Arc::new(runtime))
}

/// Faults to inject into a run (simulations and tests): each I/O request of
/// each rank's NVMe store fails, comes back short or with a flipped bit
/// with the given probabilities, decided by a hash of the seed and the
/// request (see [`strata_storage::FaultEngine`]); each placement in a
/// memory tier is refused as if the tier were full with probability `oom`
/// (see [`strata_runtime::MemoryFaults`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    /// Probabilities per request.
    pub rates: strata_storage::FaultRates,
    /// Probability that a placement in the device or host tier is refused.
    pub oom: f64,
    /// The seed.
    pub seed: u64,
}

/// The planner's view of the rank's tiers, and the state cache (its groups
/// and bytes), which the plan leaves the host room for.
fn plan_config(
    config: &TrainConfig,
    runtime: &Runtime,
    slots: &[Slot],
    groups: usize,
    links: sched::Links,
) -> Result<(sched::PlanConfig, usize, u64)> {
    let stats = runtime.stats();
    // The plan leaves the host room for what it does not schedule:
    // staging buffers of two-tier moves and demand fetches when the run
    // strays from it (else the runtime spills, and what it spills comes
    // back).
    let largest_bytes = slots
        .iter()
        .map(|s| runtime.footprint_bytes(s.meta.len_bytes())[Tier::Host.index()])
        .max()
        .unwrap_or(0);
    let mut capacity_bytes = [0, 1, 2].map(|i| stats.tiers[i].budget_bytes);
    let host = &mut capacity_bytes[Tier::Host.index()];
    let staging_bytes = (2 * largest_bytes).max(*host / 8);
    if staging_bytes >= *host {
        return Err(bad(
            "host.budget",
            config.host.budget,
            format!(
                "the runtime keeps room for staging two of the largest tensor ({largest_bytes} bytes on the host), which leaves nothing for the plan: raise host.budget well above {staging_bytes} bytes"
            ),
        ));
    }
    *host -= staging_bytes;
    let (cache_groups, cache_bytes) = state_cache(config, runtime, slots, groups);
    *host = host.saturating_sub(cache_bytes);
    let plan_config = sched::PlanConfig {
        capacity_bytes,
        links,
        policy: sched::Policy::strata(
            config.placement.prefetch_ops,
            config.placement.activation_horizon_ops,
            capacity_bytes[Tier::Device.index()].saturating_add(capacity_bytes[Tier::Host.index()]),
        ),
    };
    Ok((plan_config, cache_groups, cache_bytes))
}
