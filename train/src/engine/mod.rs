//! The training engine: one data-parallel rank of a ZeRO-3 run of a model
//! (any architecture behind [`crate::model::Model`]) whose parameters,
//! gradients, optimizer states and activations live in the runtime's tiers
//! and move under the scheduler's plans.
//!
//! Every group of parameters (the outer group: embeddings, final norm and
//! head; then each block) is cut into
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
//! The [`Engine`] holds its parts and little else; each is a struct with
//! private fields in its own module, and they talk through methods:
//! - `env`: what every part reads and none writes (config, model, groups,
//!   runtime, backend, collective);
//! - `schedule`: the ops of each shape of step, the primed tracker, the
//!   step's place in them (planned at start by `planner`, from the
//!   candidates `activations` measures; `steps` assembles the ops);
//! - `moves`: the move queue over the trace's tensors (`tensors` lays them
//!   out);
//! - `compute`: the workspace, and the backend and collective work of an
//!   op;
//! - `lane`: the optimizer lane (`optimizer`: the update's own work);
//! - `loss`: the loss scale and the step's scalars;
//! - `step_loop`: where the run is, and the order of a step's work.
//!
//! `checkpoint` writes and resumes; `run` drives whole runs over ranks and
//! is the only place that names the in-process collective.

mod access;
mod activations;
mod checkpoint;
mod compute;
mod config;
pub(crate) mod data;
pub mod deepspeed;
mod durable;
mod env;
mod evaluation;
mod lane;
mod launch;
mod loss;
mod moves;
mod optimizer;
mod planner;
mod run;
mod schedule;
mod step_loop;
mod steps;
mod stop;
mod tensors;

pub use checkpoint::{Checkpoint, CheckpointMeta, ROUNDING_STOCHASTIC};
pub use config::{
    COMM_TIMEOUT_S_DEFAULT, COS_MIN_RATIO_DEFAULT, Checkpointing, CommConfig, ComputeDtype,
    DataAttention, DataConfig, DataFormat, DataPaths, Difference, EVAL_WINDOWS_DEFAULT, EvalConfig,
    GRAD_ACCUMULATION_MAX, INIT_SEQ_DEFAULT_MAX, Keys, ModelConfig, OptimConfig, ParallelConfig,
    Placement, PlacementConfig, RANKS_MAX, RUN_CONFIG, Schedule, StateCache, StateDtype,
    TrainConfig, TrainSettings, WARMUP_NUM_STEPS_DEFAULT, WarmupType,
};
pub use data::{
    ByteCorpus, Corpus, DATA_FILES_MAX, DOCUMENT_START, DataOrder, DataPosition, DataReader,
    NOT_A_TARGET, TEXT_DOCUMENT_BYTES_MAX, TextTokenizer, TokenDtype, Tokenized, tokenize,
    tokenize_bytes, window_start,
};
pub use deepspeed::{DeepSpeedMapping, from_deepspeed_json};
pub use evaluation::Evaluation;
pub use launch::{Launch, Launcher};
pub use run::{
    CheckpointFailure, ProcessRank, Progress, RunOptions, RunSummary, collective_elems_max,
    evaluate, run, run_process,
};
pub use stop::StopRequest;

pub use env::Faults;

use std::time::Instant;

use strata_comm::Collective;
use strata_runtime::Runtime;

use crate::error::Result;
use compute::Workspace;
use env::{Env, open_runtime};
use lane::Lane;
use loss::Loss;
use moves::Moves;
use optimizer::{PoolSpread, optimizer_pool};
use planner::Planner;
use schedule::StepSchedule;
use step_loop::StepState;
use steps::estimated_block_ns;
use tensors::{links, slots};

/// Trace tensors per parameter group: two bf16 parameter shards, two
/// optimizer-state shards (current and next), one gradient shard.
const PER_GROUP: usize = 5;
/// Shapes of step: current set (0 or 1) x speculative updates (or not) x
/// late updates from the step before (or not).
const SHAPES: usize = 8;
/// Shapes of a forward-only pass (an evaluation): the set it reads.
const EVAL_SHAPES: usize = 2;

/// The index of the forward-only pass over set `current` among the
/// schedule's shapes (after every step's).
fn eval_shape(current: usize) -> usize {
    SHAPES + current
}

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
    /// The loss over the held-out data after the step's update, where the
    /// step evaluated (`[eval]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
}

/// Bytes per tier, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierBytes {
    /// Device memory (the runtime's tier plus the compute workspace).
    pub device: u64,
    /// Pinned host memory.
    pub host: u64,
    /// The NVMe swap store.
    pub nvme: u64,
}

impl TierBytes {
    pub(crate) fn from_array(bytes: [u64; 3]) -> TierBytes {
        TierBytes {
            device: bytes[0],
            host: bytes[1],
            nvme: bytes[2],
        }
    }

    /// In [`Tier::ALL`] order.
    pub fn as_array(&self) -> [u64; 3] {
        [self.device, self.host, self.nvme]
    }
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
    env: Env,
    schedule: StepSchedule,
    moves: Moves,
    ws: Workspace,
    lane: Lane,
    loss: Loss,
    state: StepState,
    /// The run's config as its checkpoints record it, where it differs
    /// from the rank's own (a process's share of the machine's budgets).
    run_config: Option<String>,
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
        let rank = collective.rank();
        let compute = Env::compute(config, &*collective)?;
        let config = &compute.config;
        let compute_dtype = config.train.compute_dtype.resolve(compute.backend.kind());
        let mut ws = Workspace::new(
            &*compute.backend,
            &*compute.model,
            config.train.micro_batch,
            &compute.groups,
            config.shards(),
            config.train.in_flight(),
            compute_dtype,
        )?;
        let workspace_bytes = ws.bytes() + compute.backend_bytes;
        let compute_ready = started.elapsed();
        // Before the runtime: its threads commit the pinned pool they update.
        let pool = match config.placement.optimizer {
            Placement::Device => None,
            _ => Some(optimizer_pool(
                config.optim.threads,
                collective.ranks_in_process(),
            )?),
        };
        let spread = pool.as_ref().map(PoolSpread);
        let spread = spread.as_ref().map(|s| s as &dyn strata_runtime::Spread);
        let context = compute.context.clone();
        let runtime = open_runtime(config, rank, workspace_bytes, faults, context, spread)?;
        let runtime_ready = started.elapsed();
        let env = Env::new(compute, runtime, collective)?;
        let kept = activations::kept_bytes(ws.buffers());
        // The rooms the activations may use: the plan's tiers less the
        // model states (measured with the smallest activations, so that
        // the host's staging reserve is not sized for the largest).
        let layers = env.model().layers();
        let every = slots(env.config(), env.groups(), kept, &vec![true; layers]);
        let rooms = planner::plan_config(
            env.config(),
            env.runtime(),
            &every,
            env.groups().len(),
            links(),
        )?
        .0;
        let candidates =
            activations::recompute_blocks(&env, &mut ws, &every, rooms.capacity_bytes)?;
        // Measured rates, when the choice measured them, cost the plans.
        let (block_ns, links) = match candidates.rates {
            Some(rates) => (rates.block_forward_ns as u64, rates.links()),
            None => (estimated_block_ns(env.config(), env.model()), links()),
        };
        let state = StepState::new(env.config().placement.optimizer != Placement::Device);
        let planner = Planner::new(&env, block_ns, links, state.speculates(), workspace_bytes);
        let planned = planner.plan(candidates.recompute, kept)?;
        let planned_at = started.elapsed();
        let mut moves = Moves::new(planned.slots, planned.cache_groups, env.groups().len());
        let io_before = process_io();
        moves.initialize(&env)?;
        if let Some(dir) = &env.config().model.init_from {
            // What the load cost the disk (the process's counters: exact
            // with one rank, the whole run's with several).
            let ((read0, written0), (read1, written1)) = (io_before, process_io());
            let seconds = (started.elapsed() - planned_at).as_secs_f64();
            tracing::info!(
                "rank {rank}: parameters loaded from {} in {seconds:.1} s: {} bytes read from disk, {} bytes written (read_bytes={} written_bytes={} seconds={seconds:.3})",
                dir.display(),
                read1.saturating_sub(read0),
                written1.saturating_sub(written0),
                read1.saturating_sub(read0),
                written1.saturating_sub(written0),
            );
        }
        let mut lane = Lane::new(optimizer_pool(1, 1)?, moves.len());
        if let Some(pool) = pool {
            // With the compute elsewhere (a GPU), the pool's cores wait for
            // nothing but the lane: it wakes them as each update arrives.
            let wake = env.backend().kind() != strata_device::DeviceKind::Cpu
                && std::env::var_os("STRATA_LANE_WAKE").is_none_or(|v| v != "0");
            lane.start(env.runtime().clone(), pool, env.groups().clone(), wake)?;
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
            (planned_at - runtime_ready).as_secs_f64(),
            (ready - planned_at).as_secs_f64(),
        );
        Ok(Engine {
            loss: Loss::new(env.config().train.scaler(), env.groups().len())?,
            schedule: planned.schedule,
            env,
            moves,
            ws,
            lane,
            state,
            run_config: None,
        })
    }

    /// Records `config` as the run's in its checkpoints (what `--resume`
    /// alone starts from) instead of this rank's own: a rank that is a
    /// process runs with its share of the machine's budgets.
    pub fn record_run_config(&mut self, config: &TrainConfig) -> Result<()> {
        self.run_config = Some(config.to_toml()?);
        Ok(())
    }

    /// The model it trains.
    pub fn model(&self) -> &dyn crate::model::Model {
        self.env.model()
    }

    /// The runtime of this rank (stats, trace).
    pub fn runtime(&self) -> &Runtime {
        self.env.runtime()
    }

    /// What the plans predict.
    pub fn prediction(&self) -> Prediction {
        self.schedule.prediction()
    }

    /// Steps run so far.
    pub fn steps_done(&self) -> u64 {
        self.state.steps()
    }

    /// Bytes of model states this rank holds: bf16 parameters, fp32
    /// gradients, master weights and two moments in `optim.state_dtype`
    /// (one set; the second set the overlapped update writes into is
    /// counted in the tier peaks).
    pub fn model_state_bytes(&self) -> u64 {
        let states = self.env.config().optim.state_dtype.bytes_per_param() as u64;
        self.env
            .groups()
            .iter()
            .map(|g| (2 + 4 + states) * g.shard as u64)
            .sum()
    }

    /// Tokens one call of [`Engine::step`] takes from this rank:
    /// `grad_accumulation x micro_batch` sequences of `seq + 1` tokens
    /// (inputs and the next-token targets).
    pub fn tokens_per_step(&self) -> usize {
        self.env.tokens_per_step()
    }

    /// Runs one step on this rank's `tokens` ([`Engine::tokens_per_step`]
    /// of them). Every rank calls it together, with its own tokens. A step
    /// that fails once begun leaves the engine refusing further calls.
    pub fn step(&mut self, tokens: &[u32]) -> Result<StepReport> {
        self.state.usable()?;
        let before = self.state.steps();
        let report = self.run_step(tokens);
        if report.is_err() && self.state.steps() != before {
            self.state.fail();
        }
        report
    }

    /// Whether any rank says `flag`; every rank calls it together.
    fn any_rank(&self, flag: bool) -> Result<bool> {
        self.env.any_rank(flag)
    }

    /// Applies the last step's update now if it is late (else it runs
    /// during the next step's forward), so that the current set holds the
    /// updated model. [`Engine::save_checkpoint`] calls it; call it before
    /// reading the weights some other way. Every rank calls it together.
    pub fn flush(&mut self) -> Result<()> {
        self.state.usable()?;
        self.apply_late()
    }
}

/// The process's bytes read from and written to storage so far
/// (`/proc/self/io`'s `read_bytes` and `write_bytes`; zeros where the
/// kernel does not say).
fn process_io() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    (field("read_bytes:"), field("write_bytes:"))
}
