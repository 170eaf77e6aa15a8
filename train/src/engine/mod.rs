//! The training engine: one data-parallel rank of a ZeRO-3 run of a
//! GPT-2-style model whose parameters, gradients, optimizer states and
//! activations live in the runtime's tiers and move under the scheduler's
//! plans.
//!
//! Every group of parameters (the embeddings, then each block) is cut into
//! one shard per rank. A step: gather the embeddings, run each block's
//! forward (all-gather its bf16 shards, keep its input, or all its
//! activations without checkpointing), the head and loss, then each
//! block's backward (recompute from the kept input, reduce-scatter the
//! gradients into this rank's fp32 gradient shard). With activation
//! checkpointing every micro-batch of the step is in flight at once and
//! each op runs for all of them in turn, so a block's parameters are
//! fetched once per pass and its gradient is summed while it is on the
//! device; without, micro-batches run one after another (only one's
//! activations alive). The sums are the same either way. Updates write the new
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

mod checkpoint;
mod config;
mod data;
mod run;

pub use checkpoint::{Checkpoint, CheckpointMeta};
pub use config::{
    GRAD_ACCUMULATION_MAX, ModelConfig, Placement, PlacementConfig, RANKS_MAX, StateCache,
    TrainConfig, TrainSettings,
};
pub use data::ByteCorpus;
pub use run::{Progress, RunOptions, RunSummary, TierBytes, run};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use half::bf16;
use strata_optim::{
    AdamCoefficients, GradNorm, Isa, LossScaler, LowPrecisionMut, Moments, StepDecision, Values,
    adam_step, decide_step, grad_norm, widen,
};
use strata_scheduler as sched;
use strata_scheduler::{Action, ActionKind, Follow, Mode, Op, Processor, StepTracker, TensorClass};
use strata_storage::ByteSize;
use strata_storage::engine::SplitMix64;

use strata_comm::Collective;
use strata_runtime::RuntimeError;

use crate::error::{Result, TrainError, bad, os};
use crate::gpt::{
    BlockActivations, BlockLayout, BlockScratch, EmbedLayout, GptConfig, HeadBuffers,
    block_backward, block_forward, embed_backward, embed_forward, head_forward_backward,
};
use strata_device::{View, ViewMut};
use strata_kernels::{Backend, CpuBackend};
use strata_runtime::{
    Access, Completion, Dtype, Guard, Runtime, TensorId, TensorKind, TensorMeta, Tier,
};

/// Trace tensors per parameter group: two bf16 parameter shards, two
/// optimizer-state shards (current and next), one gradient shard.
const PER_GROUP: usize = 5;
/// Link speeds the planner assumes for the CPU device (memory copies) and
/// the NVMe tier; they shape prefetch timing, not correctness.
const COPY_BYTES_PER_S: f64 = 8e9;
const NVME_BYTES_PER_S: f64 = 2e9;
/// What the planner assumes the compute runs at, per op.
const FLOPS_PER_S: f64 = 2e10;
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Work {
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

struct StepOp {
    work: Work,
    op: Op,
}

impl Work {
    /// How the trace names it: what, the group, the micro-batch.
    fn label(self) -> (&'static str, usize, Option<usize>) {
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

fn optimizer_label(late: bool) -> &'static str {
    if late { "late optimizer" } else { "optimizer" }
}

/// A tensor of the trace and its runtime copy.
struct Slot {
    meta: TensorMeta,
    home: Option<Tier>,
    id: Option<TensorId>,
    /// The planned move in flight, and its target tier.
    pending: Option<(Completion, Tier)>,
    /// Written by a late update this step, and in the state cache: its host copy stays for the
    /// next step's update, its write-back waits for backward.
    fresh: bool,
}

/// Compute buffers: one block's worth, held for the whole run, and the
/// streams between blocks of each micro-batch in flight at once.
struct Workspace {
    gathered: Vec<f32>,
    shard16: Vec<bf16>,
    shard32: Vec<f32>,
    grad_full: Vec<f32>,
    acts: BlockActivations,
    scratch: BlockScratch,
    head: HeadBuffers,
    saved: Vec<f32>,
    y: Vec<f32>,
    dx: Vec<f32>,
    /// Per micro-batch in flight: the forward stream, the backward stream,
    /// the embeddings' gradient, the input and target tokens.
    streams: Vec<Stream>,
}

/// One micro-batch's buffers between ops.
struct Stream {
    x: Vec<f32>,
    dy: Vec<f32>,
    dembed: Vec<f32>,
    inputs: Vec<u32>,
    targets: Vec<u32>,
}

impl Workspace {
    fn new(
        backend: &dyn Backend,
        gpt: &GptConfig,
        batch: usize,
        groups: &[Group],
        world: usize,
        checkpoint: bool,
        in_flight: usize,
    ) -> Result<Self> {
        let shard_max = groups.iter().map(|g| g.shard).max().expect("groups");
        let padded_max = shard_max * world;
        let embed_padded = groups[0].padded(world);
        let stream = batch * gpt.seq * gpt.hidden;
        let acts = BlockActivations::new(backend, gpt, batch)?;
        let saved = if checkpoint {
            stream
        } else {
            acts.view().len()
        };
        Ok(Workspace {
            gathered: vec![0.0; padded_max],
            shard16: vec![bf16::ZERO; shard_max],
            shard32: vec![0.0; shard_max],
            grad_full: vec![0.0; padded_max],
            acts,
            scratch: BlockScratch::new(backend, gpt, batch)?,
            head: HeadBuffers::new(backend, gpt, batch)?,
            saved: vec![0.0; saved],
            y: vec![0.0; stream],
            dx: vec![0.0; stream],
            streams: (0..in_flight)
                .map(|_| Stream {
                    x: vec![0.0; stream],
                    dy: vec![0.0; stream],
                    dembed: vec![0.0; embed_padded],
                    inputs: vec![0; batch * gpt.seq],
                    targets: vec![0; batch * gpt.seq],
                })
                .collect(),
        })
    }

    /// Bytes of every buffer (what they would take on a GPU).
    fn bytes(&self) -> u64 {
        let streams = self.streams.iter();
        let floats = [
            &self.gathered,
            &self.shard32,
            &self.grad_full,
            &self.saved,
            &self.y,
            &self.dx,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>()
            + streams
                .clone()
                .map(|s| s.x.len() + s.dy.len() + s.dembed.len())
                .sum::<usize>();
        let tokens = streams
            .map(|s| s.inputs.len() + s.targets.len())
            .sum::<usize>();
        let bf16s = self.shard16.len();
        (4 * floats + 2 * bf16s + 4 * tokens) as u64
            + self.acts.bytes()
            + self.scratch.bytes()
            + self.head.bytes()
    }
}

/// A parameter group's shard geometry and weight-decay runs.
#[derive(Clone, Debug)]
struct Group {
    name: String,
    params: usize,
    shard: usize,
    /// Runs of this rank's shard that are (or are not) weight-decayed.
    runs: Vec<(std::ops::Range<usize>, bool)>,
}

impl Group {
    fn padded(&self, world: usize) -> usize {
        self.shard * world
    }
}

/// An optimizer step of one group, for the CPU thread (or run inline when
/// the optimizer states live on the device).
struct OptJob {
    group: usize,
    /// The last step's update, run in this step's forward.
    late: bool,
    /// Trace indices of the tensors it writes.
    outputs: [usize; 2],
    tier: Tier,
    grad: TensorId,
    state_in: TensorId,
    state_out: TensorId,
    param_out: TensorId,
    coefficients: [AdamCoefficients; 2],
}

/// Elements of a shard the optimizer updates at once: its buffers (about
/// 300 KiB) stay in cache between reading the inputs, the update and
/// writing the outputs, so memory sees each byte of the shard once.
const OPT_PIECE_ELEMS: usize = 16 * 1024;

/// The optimizer's buffers for one piece of a shard.
struct OptScratch {
    master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    grad: Vec<f32>,
    param: Vec<bf16>,
}

impl OptScratch {
    fn new() -> OptScratch {
        OptScratch {
            master: vec![0.0; OPT_PIECE_ELEMS],
            m: vec![0.0; OPT_PIECE_ELEMS],
            v: vec![0.0; OPT_PIECE_ELEMS],
            grad: vec![0.0; OPT_PIECE_ELEMS],
            param: vec![bf16::ZERO; OPT_PIECE_ELEMS],
        }
    }
}

/// Group `job.group`'s update, streamed piece by piece from the gradient
/// and the input states' copies in `job.tier` straight into the outputs'.
/// The outputs are written whole: nothing of their old bytes is read or
/// fetched.
fn run_optimizer(
    runtime: &Runtime,
    isa: Isa,
    groups: &[Group],
    scratch: &mut OptScratch,
    job: &OptJob,
) -> Result<()> {
    let inputs = [
        guard(runtime, job.grad, job.tier, Access::Read)?,
        guard(runtime, job.state_in, job.tier, Access::Read)?,
    ];
    runtime.overwrite_with(job.param_out, job.tier, |param_out| {
        runtime.overwrite_with(job.state_out, job.tier, |state_out| {
            let outputs = [state_out, param_out];
            adam_pieces(isa, &groups[job.group], job, scratch, &inputs, outputs)
        })
    })
}

/// One shard's AdamW in pieces of [`OPT_PIECE_ELEMS`]: `[grad, states in]`
/// to `[states out, params out]`. States are master, m and v, each
/// `shard` f32, one after another; params are `shard` bf16.
fn adam_pieces(
    isa: Isa,
    group: &Group,
    job: &OptJob,
    scratch: &mut OptScratch,
    [grad, state_in]: &[Guard; 2],
    [state_out, param_out]: [&mut Guard; 2],
) -> Result<()> {
    let n = group.shard as u64;
    for (run, decays) in &group.runs {
        let coefficients = &job.coefficients[usize::from(*decays)];
        for start in run.clone().step_by(OPT_PIECE_ELEMS) {
            let len = OPT_PIECE_ELEMS.min(run.end - start);
            let at = start as u64 * 4;
            let master = &mut scratch.master[..len];
            let m = &mut scratch.m[..len];
            let v = &mut scratch.v[..len];
            let g = &mut scratch.grad[..len];
            let param = &mut scratch.param[..len];
            grad.read_range(at, bytemuck::cast_slice_mut(g))?;
            state_in.read_range(at, bytemuck::cast_slice_mut(master))?;
            state_in.read_range(at + 4 * n, bytemuck::cast_slice_mut(m))?;
            state_in.read_range(at + 8 * n, bytemuck::cast_slice_mut(v))?;
            adam_step(
                isa,
                coefficients,
                master,
                Values::F32(g),
                Moments::F32 { m, v },
                Some(LowPrecisionMut::Bf16(param)),
            );
            state_out.write_range(at, bytemuck::cast_slice(master))?;
            state_out.write_range(at + 4 * n, bytemuck::cast_slice(m))?;
            state_out.write_range(at + 8 * n, bytemuck::cast_slice(v))?;
            param_out.write_range(start as u64 * 2, bytemuck::cast_slice(param))?;
        }
    }
    Ok(())
}

/// A guard on the tensor's copy in `tier`, fetching it there first when it
/// is not (a demand fetch: the plan did not bring it, or a spill took it).
fn guard(runtime: &Runtime, id: TensorId, tier: Tier, access: Access) -> Result<Guard> {
    loop {
        match runtime.acquire(id, tier, access) {
            Ok(guard) => return Ok(guard),
            Err(RuntimeError::NotResident { .. }) => match runtime.move_to(id, tier) {
                Ok(done) => done.wait()?,
                Err(RuntimeError::Moving { .. }) => {}
                Err(err) => return Err(err.into()),
            },
            Err(err) => return Err(err.into()),
        }
    }
}

fn read_f32(runtime: &Runtime, id: TensorId, tier: Tier, out: &mut [f32]) -> Result<()> {
    Ok(guard(runtime, id, tier, Access::Read)?.read_into(bytemuck::cast_slice_mut(out))?)
}

/// A finished update: its group, the trace indices it wrote, the outcome.
type Done = (usize, [usize; 2], Result<()>);

/// Updates of one group sent to the CPU thread and not yet booked: its
/// update of the step before (late, in this step's forward) and this
/// step's. The channels both ways hold this many per group, so neither
/// side ever blocks on a full one.
const UPDATES_PER_GROUP_MAX: u32 = 2;

/// The CPU optimizer thread.
struct CpuWorker {
    jobs: Option<SyncSender<OptJob>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    /// Updates sent and not yet reported back, per group.
    outstanding: Vec<u32>,
}

impl CpuWorker {
    fn start(runtime: Arc<Runtime>, isa: Isa, groups: Arc<Vec<Group>>) -> Result<CpuWorker> {
        let outstanding = vec![0; groups.len()];
        let bound = groups.len() * UPDATES_PER_GROUP_MAX as usize;
        let (jobs, receiver) = sync_channel::<OptJob>(bound);
        let (results, done) = sync_channel(bound);
        let thread = std::thread::Builder::new()
            .name("strata-cpu-optim".into())
            .spawn(move || {
                strata_runtime::set_caller_lane(strata_runtime::OPTIMIZER_LANE);
                let mut scratch = OptScratch::new();
                for job in receiver {
                    let started = Instant::now();
                    let result = run_optimizer(&runtime, isa, &groups, &mut scratch, &job);
                    runtime.record_compute(
                        optimizer_label(job.late),
                        job.group as u32,
                        None,
                        started,
                    );
                    if results.send((job.group, job.outputs, result)).is_err() {
                        return;
                    }
                }
            })
            .map_err(|err| {
                os(
                    "start the CPU optimizer thread",
                    err,
                    "raise the process or thread limit (ulimit -u)",
                )
            })?;
        Ok(CpuWorker {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            outstanding,
        })
    }

    /// Books a finished update: no longer outstanding, its outputs (counts
    /// per trace index in `writing`) written, its error kept if first.
    fn book(
        &mut self,
        (group, outputs, result): Done,
        writing: &mut [u32],
        first_error: &mut Option<TrainError>,
    ) {
        self.outstanding[group] -= 1;
        for o in outputs {
            writing[o] -= 1;
        }
        if let Err(err) = result {
            first_error.get_or_insert(err);
        }
    }
}

impl Drop for CpuWorker {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One rank of a training run. Build it with [`Engine::new`], then call
/// [`Engine::step`] with this rank's tokens for each step.
pub struct Engine {
    config: TrainConfig,
    gpt: GptConfig,
    runtime: Arc<Runtime>,
    /// Where the model computes.
    backend: Box<dyn Backend>,
    collective: Box<dyn Collective>,
    tracker: StepTracker,
    groups: Arc<Vec<Group>>,
    slots: Vec<Slot>,
    /// The ops of each shape of step, by [`shape_index`].
    shapes: Vec<Vec<StepOp>>,
    /// Which of the two parameter/state sets is current.
    current: usize,
    ws: Workspace,
    inline: OptScratch,
    worker: Option<CpuWorker>,
    isa: Isa,
    scaler: LossScaler,
    /// Optimizer steps taken (skipped steps do not count).
    optimizer_steps: u64,
    /// The coefficients of the last step's update when it is late (runs
    /// in this step's forward).
    late: Option<[AdamCoefficients; 2]>,
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
    /// Write-backs of fresh cached states, issued once the late updates
    /// are done (the drive reads the other states first).
    deferred: Vec<usize>,
    /// Groups `0..cache_groups` have their states in the state cache.
    cache_groups: usize,
}

impl Engine {
    /// Builds rank `collective.rank()`: opens its runtime, registers and
    /// initializes its shards (the same values whatever the number of
    /// ranks), plans every shape of step and fails if one does not fit.
    pub fn new(config: &TrainConfig, collective: Box<dyn Collective>) -> Result<Engine> {
        config.validate()?;
        let gpt = config.model.gpt();
        let (world, rank) = (collective.world(), collective.rank());
        if world != config.train.ranks {
            return Err(bad(
                "train.ranks",
                config.train.ranks.to_string(),
                format!("the collective group has {world} ranks: make them agree"),
            ));
        }
        let groups = Arc::new(groups(&gpt, world, rank));
        let batch = config.train.micro_batch;
        let backend: Box<dyn Backend> = Box::new(CpuBackend);
        let ws = Workspace::new(
            &*backend,
            &gpt,
            batch,
            &groups,
            world,
            config.train.checkpoint_activations,
            in_flight(&config.train),
        )?;
        let workspace_bytes = ws.bytes();
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
        let runtime = Arc::new(Runtime::new(&runtime_config)?);
        let isa = Isa::chosen();
        let stats = runtime.stats();
        let slots = slots(config, &gpt, &groups, ws.acts.view().len());
        // The plan leaves the host room for what it does not schedule:
        // staging buffers of two-tier moves and demand fetches when the
        // run strays from it (else the runtime spills, and what it spills
        // comes back).
        let largest_bytes = slots
            .iter()
            .map(|s| runtime.footprint_bytes(s.meta.len_bytes())[Tier::Host.index()])
            .max()
            .unwrap_or(0);
        let mut capacity_bytes = [0, 1, 2].map(|i| stats.tiers[i].budget_bytes);
        let host = &mut capacity_bytes[Tier::Host.index()];
        *host = host.saturating_sub((2 * largest_bytes).max(*host / 8));
        let (cache_groups, cache_bytes) = state_cache(config, &runtime, &slots, groups.len());
        *host = host.saturating_sub(cache_bytes);
        let plan_config = sched::PlanConfig {
            capacity_bytes,
            links: links(),
            policy: sched::Policy::strata(
                config.placement.prefetch_ops,
                config.placement.activation_horizon_ops,
            ),
        };
        let layers = gpt.layers;
        let accumulation = config.train.grad_accumulation;
        let tensors = PER_GROUP * groups.len() + accumulation * layers;
        // An empty stand-in: `plan_shapes` makes the real one below.
        let tracker = StepTracker::new(plan_config.clone(), 0, 0, 1);
        let mut engine = Engine {
            config: config.clone(),
            gpt,
            runtime: runtime.clone(),
            backend,
            collective,
            tracker,
            groups: groups.clone(),
            slots,
            shapes: Vec::with_capacity(SHAPES),
            current: 0,
            ws,
            inline: OptScratch::new(),
            worker: None,
            isa,
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
            deferred: Vec::with_capacity(groups.len()),
            cache_groups: 0,
        };
        match engine.plan_shapes(&plan_config, cache_groups, cache_bytes) {
            Err(TrainError::DoesNotFit { cause }) if cache_groups > 0 => {
                // Whether the plans fit without the cache: "auto" runs so, an
                // explicit size is named as the problem.
                let mut full = plan_config.clone();
                full.capacity_bytes[Tier::Host.index()] += cache_bytes;
                engine.plan_shapes(&full, 0, 0)?;
                if let StateCache::Bytes(bytes) = config.placement.state_cache {
                    return Err(bad(
                        "placement.state_cache",
                        ByteSize(bytes),
                        format!(
                            "the plans fit the host budget only without it ({cause}): lower it, or use \"auto\""
                        ),
                    ));
                }
            }
            planned => planned?,
        }
        engine.initialize()?;
        if config.placement.optimizer != Placement::Device {
            engine.worker = Some(CpuWorker::start(runtime, isa, groups)?);
        }
        Ok(engine)
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
    /// gradients, master weights and two moments (one set; the second set
    /// the overlapped update writes into is counted in the tier peaks).
    pub fn model_state_bytes(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| (2 + 4 + 12) * g.shard as u64)
            .sum()
    }

    /// Tokens one call of [`Engine::step`] takes from this rank:
    /// `grad_accumulation x micro_batch` sequences of `seq + 1` tokens
    /// (inputs and the next-token targets).
    pub fn tokens_per_step(&self) -> usize {
        self.config.train.grad_accumulation * self.config.train.micro_batch * (self.gpt.seq + 1)
    }

    /// The ops of one shape of step: `current` set, updates `speculate`d
    /// in backward or not, the last step's `late` updates in forward or not.
    fn step_ops(&self, current: usize, speculate: bool, late: bool) -> Vec<StepOp> {
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

    /// Registers every persistent tensor at home with its initial values.
    fn initialize(&mut self) -> Result<()> {
        let world = self.collective.world();
        let rank = self.collective.rank();
        let seed = self.config.train.seed;
        for g in 0..self.groups.len() {
            let group = self.groups[g].clone();
            let mut full = vec![0.0f32; group.padded(world)];
            init_group(&self.gpt, g, seed, &mut full[..group.params]);
            let master = &full[rank * group.shard..(rank + 1) * group.shard];
            self.load_group(g, master, None)?;
            self.place_persistent(grad_index(g), None)?;
        }
        Ok(())
    }

    /// Writes group `g`'s shard: master weights, moments (zero when none),
    /// and the bf16 compute copy, into the current set; the other set is
    /// registered at home, to be overwritten by the next update.
    fn load_group(
        &mut self,
        g: usize,
        master: &[f32],
        moments: Option<(&[f32], &[f32])>,
    ) -> Result<()> {
        let n = self.groups[g].shard;
        let mut state = vec![0.0f32; 3 * n];
        state[..n].copy_from_slice(master);
        if let Some((m, v)) = moments {
            state[n..2 * n].copy_from_slice(m);
            state[2 * n..].copy_from_slice(v);
        }
        let param: Vec<bf16> = master.iter().map(|&x| bf16::from_f32(x)).collect();
        for set in 0..2 {
            let current = set == self.current;
            let p = param_index(g, set);
            let s = state_index(g, set);
            self.place_persistent(p, current.then_some(bytemuck::cast_slice(&param)))?;
            self.place_persistent(s, current.then_some(bytemuck::cast_slice(&state)))?;
        }
        Ok(())
    }

    /// (Re)creates a persistent tensor with `data` (or zeros) at its home.
    fn place_persistent(&mut self, index: usize, data: Option<&[u8]>) -> Result<()> {
        if let Some(id) = self.slots[index].id.take() {
            self.runtime.free(id)?;
        }
        let home = self.slots[index]
            .home
            .expect("persistent tensors have a home");
        let first = if home == Tier::Device {
            Tier::Device
        } else {
            Tier::Host
        };
        let id = self
            .runtime
            .register(self.slots[index].meta.clone(), first)?;
        self.slots[index].id = Some(id);
        if let Some(data) = data {
            self.runtime
                .acquire(id, first, Access::Write)?
                .write_from(data)?;
        }
        if home != first {
            self.runtime.move_to(id, home)?.wait()?;
        }
        Ok(())
    }

    /// Runs one step on this rank's `tokens` ([`Engine::tokens_per_step`]
    /// of them). Every rank calls it together, with its own tokens.
    pub fn step(&mut self, tokens: &[u32]) -> Result<StepReport> {
        assert_eq!(tokens.len(), self.tokens_per_step(), "tokens for one step");
        let started = Instant::now();
        self.step += 1;
        let step = self.step;
        let lr = self.config.train.lr_at(step);
        let loss_scale = self.scaler.scale();
        self.loss_sum = 0.0;
        self.sum_squares.fill(0.0);
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
        let world = self.collective.world();
        let micro_batches = (self.config.train.grad_accumulation * world) as f64;
        Ok(StepReport {
            step,
            loss: self.loss_sum / micro_batches,
            lr,
            grad_norm,
            clip,
            skipped,
            late,
            loss_scale,
            tokens: (tokens.len() / (self.gpt.seq + 1) * self.gpt.seq * world) as u64,
            seconds: started.elapsed().as_secs_f64(),
            optimizer_wait_s: std::mem::take(&mut self.optimizer_wait_ns) as f64 / 1e9,
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
        let coefficients = |grad_scale: f32| -> Result<[AdamCoefficients; 2]> {
            Ok([
                no_decay.coefficients(next, grad_scale)?,
                adam.coefficients(next, grad_scale)?,
            ])
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
                Work::Decide => decision = self.decide(step_op, loss_scale)?,
                Work::Optimizer { late: true, .. } => {
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

    /// Retries the held actions, then issues this boundary's planned ones
    /// of one kind: fetches and allocations before the op they were
    /// announced with runs (they overlap it), evictions and drops after it
    /// (it may still use what they release).
    fn issue_actions(&mut self, releases: bool) -> Result<()> {
        self.retry_held()?;
        for k in 0..self.actions.len() {
            let action = self.actions[k];
            if release(&action) == releases {
                self.issue(action)?;
            }
        }
        Ok(())
    }

    /// Issues the held actions again (those still waiting are held again).
    fn retry_held(&mut self) -> Result<()> {
        if self.held.is_empty() {
            return Ok(());
        }
        self.poll_worker();
        std::mem::swap(&mut self.held, &mut self.retry);
        for k in 0..self.retry.len() {
            let action = self.retry[k];
            self.issue(action)?;
        }
        self.retry.clear();
        Ok(())
    }

    /// Carries out one planned action. The plan is advice: a tensor in use
    /// or already moving keeps its place, and the op that needs it fetches
    /// it on demand.
    fn issue(&mut self, action: Action) -> Result<()> {
        let index = action.tensor as usize;
        let moving = self.slots[index]
            .pending
            .as_ref()
            .is_some_and(|(done, _)| !done.is_done());
        if self.writing[index] > 0 || moving {
            // After the update writes it, or the move in flight lands.
            self.held.push(action);
            return Ok(());
        }
        self.settle_pending(index)?;
        let Some(id) = self.slots[index].id else {
            return Ok(());
        };
        let outcome = match action.kind {
            // A copy, up or down: every other copy stays.
            ActionKind::Fetch { to, .. } => {
                let to = runtime_tier(to);
                self.runtime.copy_to(id, to).map(|done| {
                    self.slots[index].pending = Some((done, to));
                })
            }
            // Only the source copy goes: a copy above it stays in use. A
            // fresh cached state keeps its host copy for the next step's
            // update; its write-back waits for `write_back_deferred`.
            ActionKind::Evict { from, to } => {
                let to = runtime_tier(to);
                let from = runtime_tier(from);
                if self.slots[index].fresh && from == Tier::Host {
                    if !self.deferred.contains(&index) {
                        self.deferred.push(index);
                    }
                    Ok(())
                } else {
                    self.runtime.evict(id, from, to).map(|done| {
                        self.slots[index].pending = Some((done, to));
                    })
                }
            }
            ActionKind::Drop { tier } => {
                let tier = runtime_tier(tier);
                let only_copy = self.runtime.residency(id)?.iter().all(|&t| t == tier);
                let dead = self.last_use[self.shape][index] <= self.position;
                if only_copy && self.slots[index].home.is_none() && dead {
                    // A tensor of the step after its last use.
                    self.slots[index].id = None;
                    self.runtime.free(id)
                } else if only_copy {
                    Ok(())
                } else {
                    self.runtime.release(id, tier)
                }
            }
            ActionKind::Alloc { .. } => Ok(()),
        };
        tracing::trace!(
            "step {} op {}: {:?} {} -> {:?}",
            self.step,
            self.position,
            action.kind,
            self.slots[index].meta.name,
            outcome.as_ref().err()
        );
        match outcome {
            Ok(()) => Ok(()),
            Err(RuntimeError::InUse { .. }) if release(&action) => {
                // The CPU optimizer still holds it: release it once done.
                self.held.push(action);
                Ok(())
            }
            Err(
                RuntimeError::InUse { .. }
                | RuntimeError::Moving { .. }
                | RuntimeError::NotResident { .. },
            ) => Ok(()),
            Err(err) => Err(err.into()),
        }
    }

    /// Starts writing the fresh cached states home, keeping their host
    /// copies. One in use or moving is left to `return_home`, which waits
    /// for its home copy.
    fn write_back_deferred(&mut self) -> Result<()> {
        for k in 0..self.deferred.len() {
            let index = self.deferred[k];
            self.settle_pending(index)?;
            let id = self.slots[index].id.expect("written this step");
            match self.runtime.copy_to(id, Tier::Nvme) {
                Ok(done) => self.slots[index].pending = Some((done, Tier::Nvme)),
                Err(RuntimeError::InUse { .. } | RuntimeError::Moving { .. }) => {}
                Err(err) => return Err(err.into()),
            }
        }
        self.deferred.clear();
        Ok(())
    }

    fn settle_pending(&mut self, index: usize) -> Result<()> {
        match self.slots[index].pending.take() {
            Some((done, _)) => Ok(done.wait()?),
            None => Ok(()),
        }
    }

    /// Waits for a planned fetch of the tensor to `tier`, where an op is
    /// about to use it; a move elsewhere (a write-back) is left in flight.
    fn settle_fetch(&mut self, index: usize, tier: Tier) -> Result<()> {
        match &self.slots[index].pending {
            Some((_, to)) if *to == tier => self.settle_pending(index),
            _ => Ok(()),
        }
    }

    /// Tells the tracker the op starts and issues the plan's actions for
    /// the boundary after it.
    fn announce(&mut self, op: &Op) -> Result<()> {
        self.position += 1;
        self.actions.clear();
        if let Follow::Plan(actions) = self.tracker.op(op)? {
            self.actions.extend_from_slice(actions);
        }
        self.issue_actions(false)
    }

    /// Tells the tracker the op starts, issues the plan's next actions,
    /// and runs it.
    fn run_op(
        &mut self,
        step_op: &StepOp,
        tokens: &[u32],
        update: &[AdamCoefficients; 2],
    ) -> Result<()> {
        if let (Work::Optimizer { g, late }, Some(_)) = (step_op.work, &self.worker) {
            // Queued before the boundary's actions are issued, so that moves
            // of what it writes wait for it (else they carry stale bytes).
            // Its thread waits for its inputs' moves itself.
            self.update_group(g, late, processor_tier(step_op.op.processor), update)?;
            self.announce(&step_op.op)?;
            return self.issue_actions(true);
        }
        let started = Instant::now();
        self.announce(&step_op.op)?;
        let tier = processor_tier(step_op.op.processor);
        for access in &step_op.op.accesses {
            self.settle_fetch(access.tensor as usize, tier)?;
        }
        let batch = self.config.train.micro_batch;
        let world = self.collective.world();
        let streams = self.ws.streams.len();
        match step_op.work {
            Work::EmbedForward { m } => {
                self.gather(0)?;
                let stream = &mut self.ws.streams[m % streams];
                split_tokens(
                    tokens,
                    m,
                    batch,
                    self.gpt.seq,
                    &mut stream.inputs,
                    &mut stream.targets,
                );
                let embed = &self.ws.gathered[..self.groups[0].params];
                embed_forward(
                    &*self.backend,
                    &self.gpt,
                    View::host_slice(embed),
                    View::host_slice(&stream.inputs),
                    ViewMut::host_slice(&mut stream.x),
                )?;
            }
            Work::BlockForward { m, b } => {
                self.gather(b + 1)?;
                let ws = &mut self.ws;
                let stream = &mut ws.streams[m % streams];
                let params = &ws.gathered[..self.groups[b + 1].params];
                block_forward(
                    &*self.backend,
                    &self.gpt,
                    batch,
                    View::host_slice(params),
                    View::host_slice(&stream.x),
                    &mut ws.acts,
                    &mut ws.scratch,
                    ViewMut::host_slice(&mut ws.y),
                )?;
                std::mem::swap(&mut stream.x, &mut ws.y);
                let kept = if self.config.train.checkpoint_activations {
                    ws.acts.input()
                } else {
                    ws.acts.view()
                };
                self.backend
                    .copy(kept, ViewMut::host_slice(&mut ws.saved))?;
                let index = self.saved_index(m, b);
                self.write_tensor(index, Tier::Device, Kept::Saved)?;
            }
            Work::Head { m } => {
                if m == 0 {
                    self.write_back_deferred()?;
                }
                self.gather(0)?;
                let scale =
                    self.scaler.scale() / (self.config.train.grad_accumulation * world) as f32;
                let embed_params = self.groups[0].params;
                let ws = &mut self.ws;
                let stream = &mut ws.streams[m % streams];
                stream.dembed.fill(0.0);
                let loss = head_forward_backward(
                    &*self.backend,
                    &self.gpt,
                    View::host_slice(&ws.gathered[..embed_params]),
                    View::host_slice(&stream.x),
                    View::host_slice(&stream.targets),
                    scale,
                    &mut ws.head,
                    ViewMut::host_slice(&mut stream.dy),
                    ViewMut::host_slice(&mut stream.dembed[..embed_params]),
                )?;
                self.loss_sum += loss.get()?;
            }
            Work::BlockBackward { m, b } => {
                self.gather(b + 1)?;
                let index = self.saved_index(m, b);
                let id = self.slots[index].id.expect("saved in forward");
                read_f32(&self.runtime, id, Tier::Device, &mut self.ws.saved)?;
                let ws = &mut self.ws;
                let params = View::host_slice(&ws.gathered[..self.groups[b + 1].params]);
                if self.config.train.checkpoint_activations {
                    block_forward(
                        &*self.backend,
                        &self.gpt,
                        batch,
                        params,
                        View::host_slice(&ws.saved),
                        &mut ws.acts,
                        &mut ws.scratch,
                        ViewMut::host_slice(&mut ws.y),
                    )?;
                } else {
                    self.backend
                        .copy(View::host_slice(&ws.saved), ws.acts.view_mut())?;
                }
                let padded = self.groups[b + 1].padded(world);
                ws.grad_full[..padded].fill(0.0);
                let stream = &mut ws.streams[m % streams];
                block_backward(
                    &*self.backend,
                    &self.gpt,
                    batch,
                    params,
                    &ws.acts,
                    View::host_slice(&stream.dy),
                    &mut ws.scratch,
                    ViewMut::host_slice(&mut ws.dx),
                    ViewMut::host_slice(&mut ws.grad_full[..self.groups[b + 1].params]),
                )?;
                std::mem::swap(&mut ws.dx, &mut stream.dy);
                self.reduce_gradient(b + 1, m)?;
            }
            Work::EmbedBackward { m } => {
                let embed_params = self.groups[0].params;
                let stream = &mut self.ws.streams[m % streams];
                embed_backward(
                    &*self.backend,
                    &self.gpt,
                    View::host_slice(&stream.inputs),
                    View::host_slice(&stream.dy),
                    ViewMut::host_slice(&mut stream.dembed[..embed_params]),
                )?;
                self.reduce_gradient(0, m)?;
            }
            Work::Optimizer { g, late } => self.update_group(g, late, tier, update)?,
            Work::Decide => unreachable!("decided by Engine::decide"),
            Work::Commit => self.wait_worker(None)?,
        }
        let (what, group, micro_batch) = step_op.work.label();
        self.runtime
            .record_compute(what, group as u32, micro_batch.map(|m| m as u32), started);
        self.issue_actions(true)
    }

    fn saved_index(&self, m: usize, b: usize) -> usize {
        PER_GROUP * self.groups.len() + m * self.gpt.layers + b
    }

    /// All-gathers group `g`'s current bf16 shards into the workspace (as
    /// f32: the values are bf16's).
    fn gather(&mut self, g: usize) -> Result<()> {
        // A late update of the group writes the parameters read here.
        self.wait_worker(Some(g))?;
        let index = param_index(g, self.current);
        let id = self.slots[index].id.expect("parameters are registered");
        let n = self.groups[g].shard;
        guard(&self.runtime, id, Tier::Device, Access::Read)?
            .read_into(bytemuck::cast_slice_mut(&mut self.ws.shard16[..n]))?;
        widen(
            self.isa,
            Values::Bf16(&self.ws.shard16[..n]),
            &mut self.ws.shard32[..n],
        );
        let padded = self.groups[g].padded(self.collective.world());
        self.collective
            .all_gather(
                View::host_slice(&self.ws.shard32[..n]),
                ViewMut::host_slice(&mut self.ws.gathered[..padded]),
            )?
            .wait()?;
        Ok(())
    }

    /// Reduce-scatters the full gradient in the workspace into group `g`'s
    /// shard: written in micro-batch 0, added to after.
    fn reduce_gradient(&mut self, g: usize, m: usize) -> Result<()> {
        let n = self.groups[g].shard;
        let padded = self.groups[g].padded(self.collective.world());
        // The embeddings' gradient gathers the head's and the embedding's
        // parts over the whole backward in its own buffer.
        let streams = self.ws.streams.len();
        let full = if g == 0 {
            &self.ws.streams[m % streams].dembed
        } else {
            &self.ws.grad_full
        };
        self.collective
            .reduce_scatter(
                View::host_slice(&full[..padded]),
                ViewMut::host_slice(&mut self.ws.shard32[..n]),
            )?
            .wait()?;
        let index = grad_index(g);
        let last = m + 1 == self.config.train.grad_accumulation;
        if m == 0 {
            if last {
                self.sum_squares[g] =
                    grad_norm(self.isa, Values::F32(&self.ws.shard32[..n])).sum_squares;
            }
            self.write_tensor(index, Tier::Device, Kept::Shard(n))
        } else {
            let id = self.slots[index].id.expect("written in micro-batch 0");
            let mut held = guard(&self.runtime, id, Tier::Device, Access::Write)?;
            // The full gradient is reduced: its buffer is free for the sum.
            let sum = &mut self.ws.grad_full[..n];
            held.read_into(bytemuck::cast_slice_mut(sum))?;
            for (sum, add) in sum.iter_mut().zip(&self.ws.shard32[..n]) {
                *sum += add;
            }
            if last {
                self.sum_squares[g] = grad_norm(self.isa, Values::F32(sum)).sum_squares;
            }
            Ok(held.write_from(bytemuck::cast_slice(sum))?)
        }
    }

    /// Writes a workspace buffer whole into a tensor on `tier` (registered
    /// first when the step has none yet); its old bytes are not read.
    fn write_tensor(&mut self, index: usize, tier: Tier, kept: Kept) -> Result<()> {
        self.settle_pending(index)?;
        let id = match self.slots[index].id {
            Some(id) => id,
            None => {
                let id = self
                    .runtime
                    .register(self.slots[index].meta.clone(), tier)?;
                self.slots[index].id = Some(id);
                id
            }
        };
        let data: &[u8] = match kept {
            Kept::Saved => bytemuck::cast_slice(&self.ws.saved),
            Kept::Shard(n) => bytemuck::cast_slice(&self.ws.shard32[..n]),
        };
        Ok(self.runtime.overwrite(id, tier, data)?)
    }

    /// Starts (on the CPU thread) or runs group `g`'s update from one set
    /// into the other, on `tier`.
    fn update_group(
        &mut self,
        g: usize,
        late: bool,
        tier: Tier,
        update: &[AdamCoefficients; 2],
    ) -> Result<()> {
        let (from, to) = update_sets(self.current, late);
        self.slots[state_index(g, to)].fresh = late && g < self.cache_groups;
        let outputs = [state_index(g, to), param_index(g, to)];
        let id = |index: usize| {
            self.slots[index]
                .id
                .expect("persistent tensors are registered")
        };
        let job = OptJob {
            group: g,
            late,
            outputs,
            tier,
            grad: id(grad_index(g)),
            state_in: id(state_index(g, from)),
            state_out: id(state_index(g, to)),
            param_out: id(param_index(g, to)),
            coefficients: *update,
        };
        match &mut self.worker {
            Some(worker) => {
                assert!(
                    worker.outstanding[g] < UPDATES_PER_GROUP_MAX,
                    "group {g} has {} updates outstanding",
                    worker.outstanding[g]
                );
                worker
                    .jobs
                    .as_ref()
                    .expect("open while the engine lives")
                    .send(job)
                    .map_err(|_| RuntimeError::Stopped)?;
                worker.outstanding[g] += 1;
                for o in outputs {
                    self.writing[o] += 1;
                }
                Ok(())
            }
            None => run_optimizer(
                &self.runtime,
                self.isa,
                &self.groups,
                &mut self.inline,
                &job,
            ),
        }
    }

    /// Takes the results of the updates the CPU thread has finished,
    /// without waiting.
    fn poll_worker(&mut self) {
        let Some(worker) = &mut self.worker else {
            return;
        };
        while let Ok(done) = worker.done.try_recv() {
            worker.book(done, &mut self.writing, &mut self.worker_error);
        }
    }

    /// Waits until the CPU thread has no update of group `g` (every group
    /// with None) outstanding; returns the first error it reported.
    fn wait_worker(&mut self, g: Option<usize>) -> Result<()> {
        let started = Instant::now();
        let mut waited = false;
        while let Some(worker) = &mut self.worker {
            let busy = match g {
                Some(g) => worker.outstanding[g] > 0,
                None => worker.outstanding.iter().any(|&n| n > 0),
            };
            if !busy {
                break;
            }
            waited = true;
            let done = worker.done.recv().map_err(|_| RuntimeError::Stopped)?;
            worker.book(done, &mut self.writing, &mut self.worker_error);
            // The moves held for this update go now, not at the next
            // boundary: a long wait (the commit's) would otherwise keep
            // every finished update's inputs and outputs on the host.
            self.retry_held()?;
        }
        if waited {
            self.optimizer_wait_ns += started.elapsed().as_nanos() as u64;
            // (A commit's wait is its whole span already.)
            if let Some(g) = g {
                self.runtime
                    .record_compute("wait for optimizer", g as u32, None, started);
            }
        }
        self.worker_error.take().map_or(Ok(()), Err)
    }

    /// The barrier: every update is in, the global norm and the overflow
    /// check decide what happens to them.
    fn decide(&mut self, step_op: &StepOp, loss_scale: f32) -> Result<StepDecision> {
        self.announce(&step_op.op)?;
        let mut sums = [self.sum_squares.iter().sum::<f64>(), self.loss_sum];
        self.collective.all_reduce_scalars(&mut sums)?;
        self.loss_sum = sums[1];
        self.issue_actions(true)?;
        let clip = self.config.train.clip_norm;
        Ok(decide_step(
            GradNorm {
                sum_squares: sums[0],
            },
            loss_scale,
            (clip > 0.0).then_some(clip),
        ))
    }

    /// Writes a checkpoint of the state after the last step under `root`
    /// (see [`checkpoint`](self) for the layout); every rank calls it
    /// together. Returns the checkpoint's directory.
    pub fn save_checkpoint(&mut self, root: &Path) -> Result<PathBuf> {
        self.flush()?;
        let (rank, world) = (self.collective.rank(), self.collective.world());
        let step = self.step;
        let tmp = root.join(format!(".tmp-step{step}"));
        let begun = if rank == 0 {
            checkpoint::begin(root, step).map(drop)
        } else {
            Ok(())
        };
        self.agree(begun)?;
        let mut shard = Vec::with_capacity(3 * self.groups.len());
        let mut weights = Vec::new();
        for g in 0..self.groups.len() {
            let n = self.groups[g].shard;
            let mut state = vec![0.0f32; 3 * n];
            self.read_state(g, &mut state)?;
            let padded = self.groups[g].padded(world);
            self.collective
                .all_gather(
                    View::host_slice(&state[..n]),
                    ViewMut::host_slice(&mut self.ws.gathered[..padded]),
                )?
                .wait()?;
            if rank == 0 {
                let mut at = 0;
                for (name, shape) in checkpoint::part_names(&self.gpt, g) {
                    let len: usize = shape.iter().product();
                    weights.push((name, shape, self.ws.gathered[at..at + len].to_vec()));
                    at += len;
                }
            }
            let name = &self.groups[g].name;
            shard.push((format!("{name}.master"), vec![n], state[..n].to_vec()));
            shard.push((format!("{name}.exp_avg"), vec![n], state[n..2 * n].to_vec()));
            shard.push((
                format!("{name}.exp_avg_sq"),
                vec![n],
                state[2 * n..].to_vec(),
            ));
        }
        let written = (|| {
            let path = tmp.join(format!("optimizer-rank{rank}.safetensors"));
            checkpoint::write_synced(&path, &checkpoint::safetensors_bytes(&path, &shard)?)?;
            if rank == 0 {
                let path = tmp.join("model.safetensors");
                checkpoint::write_synced(&path, &checkpoint::safetensors_bytes(&path, &weights)?)?;
            }
            Ok(())
        })();
        self.agree(written)?;
        let committed = if rank == 0 {
            let meta = CheckpointMeta {
                format: checkpoint::FORMAT,
                step,
                optimizer_steps: self.optimizer_steps,
                ranks: world,
                seed: self.config.train.seed,
                model: self.config.model,
                loss_scaler: self.scaler.state(),
                files: Default::default(),
            };
            checkpoint::commit(root, &tmp, meta)
                .and_then(|_| checkpoint::prune(root, self.config.train.checkpoints_kept))
        } else {
            Ok(())
        };
        self.agree(committed)?;
        Ok(root.join(format!("step-{step:08}")))
    }

    /// Loads a checkpoint written by a run of the same model, ranks and
    /// seed: the next step computes what the uninterrupted run's did.
    pub fn resume(&mut self, checkpoint: &Checkpoint) -> Result<()> {
        let meta = &checkpoint.meta;
        let rank = self.collective.rank();
        let path = checkpoint
            .dir
            .join(format!("optimizer-rank{rank}.safetensors"));
        let mismatch = |what: &str, found: String, here: String| TrainError::Checkpoint {
            path: checkpoint.dir.clone(),
            problem: format!("it was written with {what} {found}, this run has {here}"),
            fix: format!("resume with the {what} it was written with"),
        };
        if meta.model != self.config.model {
            return Err(mismatch(
                "[model]",
                format!("{:?}", meta.model),
                format!("{:?}", self.config.model),
            ));
        }
        if meta.ranks != self.collective.world() {
            return Err(mismatch(
                "train.ranks",
                meta.ranks.to_string(),
                self.collective.world().to_string(),
            ));
        }
        if meta.seed != self.config.train.seed {
            return Err(mismatch(
                "train.seed",
                meta.seed.to_string(),
                self.config.train.seed.to_string(),
            ));
        }
        let bytes = checkpoint.read_file(&format!("optimizer-rank{rank}.safetensors"))?;
        let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|err| {
            TrainError::Checkpoint {
                path: path.clone(),
                problem: format!("not a safetensors file: {err}"),
                fix: "resume from another checkpoint".into(),
            }
        })?;
        for g in 0..self.groups.len() {
            let (name, n) = (self.groups[g].name.clone(), self.groups[g].shard);
            let master = checkpoint::read_tensor(&path, &file, &format!("{name}.master"), n)?;
            let m = checkpoint::read_tensor(&path, &file, &format!("{name}.exp_avg"), n)?;
            let v = checkpoint::read_tensor(&path, &file, &format!("{name}.exp_avg_sq"), n)?;
            self.load_group(g, &master, Some((&m, &v)))?;
        }
        self.scaler.restore(meta.loss_scaler)?;
        self.step = meta.step;
        self.optimizer_steps = meta.optimizer_steps;
        Ok(())
    }

    /// Group `g`'s current master weights and moments, read where they
    /// are and left at home.
    fn read_state(&mut self, g: usize, out: &mut [f32]) -> Result<()> {
        let index = state_index(g, self.current);
        let id = self.slots[index].id.expect("states registered");
        let home = self.slots[index].home.expect("states have a home");
        let tier = if self.runtime.residency(id)?.contains(&Tier::Device) {
            Tier::Device
        } else {
            Tier::Host
        };
        read_f32(&self.runtime, id, tier, out)?;
        if home == Tier::Nvme {
            self.runtime.move_to(id, Tier::Nvme)?.wait()?;
        }
        Ok(())
    }

    /// Every rank's outcome of a part each did: this rank's error, or one
    /// naming the rank that failed.
    fn agree(&self, outcome: Result<()>) -> Result<()> {
        let world = self.collective.world();
        let rank = self.collective.rank();
        let mut failed = vec![0.0f64; world.min(strata_comm::SCALARS_MAX)];
        if outcome.is_err() {
            let slot = rank.min(failed.len() - 1);
            failed[slot] = 1.0;
        }
        self.collective.all_reduce_scalars(&mut failed)?;
        outcome?;
        match failed.iter().position(|&f| f > 0.0) {
            Some(other) => Err(TrainError::Rank {
                rank: other,
                cause: "it could not write its part of the checkpoint".into(),
            }),
            None => Ok(()),
        }
    }

    /// Applies the last step's update now if it is late (else it runs
    /// during the next step's forward), so that the current set holds the
    /// updated model. [`Engine::save_checkpoint`] calls it; call it before
    /// reading the weights some other way. Every rank calls it together.
    pub fn flush(&mut self) -> Result<()> {
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

    /// Waits for moves in flight, frees the step's own tensors and puts
    /// every persistent one back home alone.
    fn return_home(&mut self) -> Result<()> {
        self.held.clear();
        self.deferred.clear();
        for index in 0..self.slots.len() {
            self.settle_pending(index)?;
        }
        for index in 0..self.slots.len() {
            let Some(id) = self.slots[index].id else {
                continue;
            };
            match self.slots[index].home {
                None => {
                    self.runtime.free(id)?;
                    self.slots[index].id = None;
                }
                Some(home) => {
                    let keep = std::mem::take(&mut self.slots[index].fresh);
                    if !self.runtime.residency(id)?.contains(&home) {
                        self.runtime.copy_to(id, home)?.wait()?;
                    }
                    for tier in self.runtime.residency(id)? {
                        if tier != home && !(keep && tier == Tier::Host) {
                            self.runtime.release(id, tier)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// The sets an update reads and writes: a speculative one reads the
/// `current` set and writes the other; a late one (the last step's) reads
/// the set before and writes the current one.
fn update_sets(current: usize, late: bool) -> (usize, usize) {
    if late {
        (1 - current, current)
    } else {
        (current, 1 - current)
    }
}

/// Where the optimizer reads gradients and runs its updates.
fn optimizer_tier(placement: Placement) -> Tier {
    match placement {
        Placement::Device => Tier::Device,
        _ => Tier::Host,
    }
}

/// The tier an op's processor works in.
fn processor_tier(processor: Processor) -> Tier {
    match processor {
        Processor::Gpu => Tier::Device,
        Processor::Cpu => Tier::Host,
    }
}

/// The index of a shape of step: which set is current, whether updates
/// are speculative, whether the last step's update runs late in this one.
fn shape_index(current: usize, speculate: bool, late: bool) -> usize {
    current * 4 + usize::from(speculate) * 2 + usize::from(late)
}

fn shape_of(index: usize) -> (usize, bool, bool) {
    (index / 4, index & 2 != 0, index & 1 != 0)
}

/// Trace indices of a group's tensors: parameter set `set` (0 or 1), state
/// set `set`, and the gradient.
fn param_index(g: usize, set: usize) -> usize {
    PER_GROUP * g + set
}

fn state_index(g: usize, set: usize) -> usize {
    PER_GROUP * g + 2 + set
}

fn grad_index(g: usize) -> usize {
    PER_GROUP * g + 4
}

fn access(tensor: usize, mode: Mode) -> sched::Access {
    sched::Access {
        tensor: tensor as u32,
        mode,
    }
}

fn step_op(
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

/// Whether an action releases a copy (issued after its op ran).
fn release(action: &Action) -> bool {
    matches!(
        action.kind,
        ActionKind::Evict { .. } | ActionKind::Drop { .. }
    )
}

/// What a write takes from the workspace.
#[derive(Clone, Copy)]
enum Kept {
    Saved,
    Shard(usize),
}

/// The state cache: how many leading groups' states fit in it, and their
/// host bytes (none unless the states live on NVMe).
fn state_cache(
    config: &TrainConfig,
    runtime: &Runtime,
    slots: &[Slot],
    groups: usize,
) -> (usize, u64) {
    let bytes_max = match (config.placement.optimizer, config.placement.state_cache) {
        (Placement::Nvme, StateCache::Auto) => runtime.stats().tier(Tier::Host).budget_bytes / 4,
        (Placement::Nvme, StateCache::Bytes(bytes)) => bytes,
        _ => 0,
    };
    let mut cached = (0, 0);
    while cached.0 < groups {
        let state = slots[state_index(cached.0, 0)].meta.len_bytes();
        let bytes = runtime.footprint_bytes(state)[Tier::Host.index()];
        if cached.1 + bytes > bytes_max {
            break;
        }
        cached = (cached.0 + 1, cached.1 + bytes);
    }
    cached
}

/// Micro-batches in flight at once: all of them with activation
/// checkpointing (their kept inputs are small), else one.
fn in_flight(train: &TrainSettings) -> usize {
    if train.checkpoint_activations {
        train.grad_accumulation
    } else {
        1
    }
}

/// Micro-batch `m`'s inputs and next-token targets out of the step's
/// sequences of `seq + 1` tokens.
fn split_tokens(
    tokens: &[u32],
    m: usize,
    batch: usize,
    seq: usize,
    inputs: &mut [u32],
    targets: &mut [u32],
) {
    let micro = &tokens[m * batch * (seq + 1)..(m + 1) * batch * (seq + 1)];
    for (i, sequence) in micro.chunks_exact(seq + 1).enumerate() {
        inputs[i * seq..(i + 1) * seq].copy_from_slice(&sequence[..seq]);
        targets[i * seq..(i + 1) * seq].copy_from_slice(&sequence[1..]);
    }
}

/// The most floats one collective call carries: a whole (padded) group.
fn collective_elems_max(gpt: &GptConfig, world: usize) -> usize {
    let shard_max = groups(gpt, world, 0).iter().map(|g| g.shard).max();
    shard_max.expect("groups") * world
}

/// The parameter groups (embeddings, then each block) and this rank's
/// shard of each.
fn groups(gpt: &GptConfig, world: usize, rank: usize) -> Vec<Group> {
    let embed = EmbedLayout::new(gpt);
    let block = BlockLayout::new(gpt.hidden);
    let mut groups = Vec::with_capacity(gpt.layers + 1);
    for g in 0..=gpt.layers {
        let (name, params) = match g {
            0 => ("embed".to_string(), embed.total),
            _ => (format!("block{}", g - 1), block.total),
        };
        let shard = params.div_ceil(world);
        let begin = rank * shard;
        let decays = |i: usize| {
            i < params
                && if g == 0 {
                    embed.is_matrix(i)
                } else {
                    block.is_matrix(i)
                }
        };
        let mut runs: Vec<(std::ops::Range<usize>, bool)> = Vec::new();
        for i in 0..shard {
            let d = decays(begin + i);
            match runs.last_mut() {
                Some((range, last)) if *last == d => range.end = i + 1,
                _ => runs.push((i..i + 1, d)),
            }
        }
        groups.push(Group {
            name,
            params,
            shard,
            runs,
        });
    }
    groups
}

/// The trace's tensors: per group two parameter sets, two state sets and
/// the gradient; then what each block keeps for its backward, per
/// micro-batch.
/// `activation_elems` is what a block keeps for its backward without
/// checkpointing.
fn slots(
    config: &TrainConfig,
    gpt: &GptConfig,
    groups: &[Group],
    activation_elems: usize,
) -> Vec<Slot> {
    let params_home = config.placement.params.tier();
    let states_home = config.placement.optimizer.tier();
    // Gradients outlive their step when its update runs late, in the next
    // one: they stay where the optimizer reads them.
    let grads_home = optimizer_tier(config.placement.optimizer);
    let slot = |name: String, kind, dtype, elements: usize, home| Slot {
        meta: TensorMeta::new(name, kind, dtype, &[elements as u64]),
        home,
        id: None,
        pending: None,
        fresh: false,
    };
    let mut slots = Vec::new();
    for group in groups {
        let n = group.shard;
        for set in 0..2 {
            slots.push(slot(
                format!("{}.param{set}", group.name),
                TensorKind::Param,
                Dtype::Bf16,
                n,
                Some(params_home),
            ));
        }
        for set in 0..2 {
            slots.push(slot(
                format!("{}.optim{set}", group.name),
                TensorKind::OptimizerState,
                Dtype::F32,
                3 * n,
                Some(states_home),
            ));
        }
        slots.push(slot(
            format!("{}.grad", group.name),
            TensorKind::Grad,
            Dtype::F32,
            n,
            Some(grads_home),
        ));
    }
    let saved = if config.train.checkpoint_activations {
        config.train.micro_batch * gpt.seq * gpt.hidden
    } else {
        activation_elems
    };
    for m in 0..config.train.grad_accumulation {
        for b in 0..gpt.layers {
            slots.push(slot(
                format!("block{b}.saved.mb{m}"),
                TensorKind::Activation,
                Dtype::F32,
                saved,
                None,
            ));
        }
    }
    slots
}

/// GPT-2's initialization of group `g`, the same whatever the ranks: normal
/// (0, 0.02) weights, residual projections scaled by 1/sqrt(2 layers),
/// LayerNorm scales 1, biases 0.
fn init_group(gpt: &GptConfig, g: usize, seed: u64, out: &mut [f32]) {
    let mut rng = SplitMix64(seed ^ (g as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let h = gpt.hidden;
    if g == 0 {
        let layout = EmbedLayout::new(gpt);
        let matrices = gpt.vocab * h + gpt.seq * h;
        for x in &mut out[..matrices] {
            *x = 0.02 * normal(&mut rng);
        }
        out[matrices..matrices + h].fill(1.0);
        out[matrices + h..layout.total].fill(0.0);
        return;
    }
    let layout = BlockLayout::new(h);
    let residual = 0.02 / (2.0 * gpt.layers as f32).sqrt();
    // Parts in layout order: ln1 (g, b), qkv (w, b), proj (w, b), ln2 (g,
    // b), fc1 (w, b), fc2 (w, b).
    let sizes = [
        h,
        h,
        3 * h * h,
        3 * h,
        h * h,
        h,
        h,
        h,
        4 * h * h,
        4 * h,
        4 * h * h,
        h,
    ];
    let mut at = 0;
    for (part, size) in sizes.iter().enumerate() {
        let piece = &mut out[at..at + size];
        match part {
            0 | 6 => piece.fill(1.0),
            2 | 8 => piece.iter_mut().for_each(|x| *x = 0.02 * normal(&mut rng)),
            4 | 10 => piece
                .iter_mut()
                .for_each(|x| *x = residual * normal(&mut rng)),
            _ => piece.fill(0.0),
        }
        at += size;
    }
    debug_assert_eq!(at, layout.total);
}

/// A normal deviate by Box-Muller from the shared seeded generator.
fn normal(rng: &mut SplitMix64) -> f32 {
    // Uniforms in (0, 1], so the logarithm is finite.
    let mut uniform = || ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
    let (u, v) = (uniform(), uniform());
    ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
}

fn links() -> sched::Links {
    let copy = sched::Link {
        bytes_per_s: COPY_BYTES_PER_S,
        latency_ns: 10_000,
    };
    let nvme = sched::Link {
        bytes_per_s: NVME_BYTES_PER_S,
        latency_ns: 100_000,
    };
    sched::Links {
        host_to_device: copy,
        device_to_host: copy,
        nvme_read: nvme,
        nvme_write: nvme,
        nvme_duplex: false,
    }
}

/// The planner's view of the tensors: each as large as the most it takes
/// in any tier (buffers and extents are whole).
fn specs(runtime: &Runtime, slots: &[Slot]) -> Vec<sched::TensorSpec> {
    slots
        .iter()
        .map(|slot| sched::TensorSpec {
            name: slot.meta.name.clone(),
            bytes: runtime
                .footprint_bytes(slot.meta.len_bytes())
                .into_iter()
                .max()
                .expect("three tiers"),
            class: class_of(slot.meta.kind),
            home: slot.home.map(sched_tier),
        })
        .collect()
}

fn class_of(kind: TensorKind) -> TensorClass {
    match kind {
        TensorKind::Param => TensorClass::Param,
        TensorKind::Grad => TensorClass::Grad,
        TensorKind::OptimizerState => TensorClass::OptimizerState,
        TensorKind::Activation => TensorClass::Activation,
    }
}

fn sched_tier(tier: Tier) -> sched::Tier {
    match tier {
        Tier::Device => sched::Tier::Device,
        Tier::Host => sched::Tier::Host,
        Tier::Nvme => sched::Tier::Nvme,
    }
}

fn runtime_tier(tier: sched::Tier) -> Tier {
    match tier {
        sched::Tier::Device => Tier::Device,
        sched::Tier::Host => Tier::Host,
        sched::Tier::Nvme => Tier::Nvme,
    }
}
