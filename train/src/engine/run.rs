//! A whole run: one [`Engine`] per data-parallel rank, each on its own
//! thread over an in-process collective, stepping together; checkpoints
//! on schedule; a summary of losses, speed and memory per tier against the
//! plans' prediction.

use std::path::{Path, PathBuf};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::evaluation::Evaluation;
use super::{
    ByteCorpus, Checkpoint, Corpus, DataReader, Engine, StepReport, StopRequest, TierBytes,
    TrainConfig,
};
use crate::error::{Result, TrainError, os};
use strata_comm::{Collective, InProcess};
use strata_device::Cancel;
use strata_runtime::Stats;
use strata_runtime::Tier;
use strata_storage::{DirLock, Holder, LockWait, StorageError};

/// The stop code of a rank that saw no request itself but stopped because
/// a peer did (in-process ranks share the request, so only a rank of
/// another process could see this).
const STOPPED_BY_PEER: i32 = i32::MAX;

/// What a run does besides training.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Stop after this step (default: `train.steps`).
    pub stop_after: Option<u64>,
    /// Resume from this checkpoint (a `step-*` directory or a checkpoint
    /// root with `latest`).
    pub resume: Option<PathBuf>,
    /// Where rank 0's Chrome/Perfetto trace goes.
    pub trace: Option<PathBuf>,
    /// Start a new run in a checkpoint directory that holds another run's
    /// checkpoints (without it, that is refused unless resuming).
    pub overwrite: bool,
    /// Set from outside (a signal) to stop at the next step boundary,
    /// with a final checkpoint when the run has a checkpoint directory.
    pub stop: StopRequest,
    /// Storage faults to inject (simulations and tests).
    pub faults: Option<super::Faults>,
    /// The held-out data `[eval]` evaluates on (cut for the model's
    /// sequences), opened by the caller as the training data is.
    pub eval: Option<Corpus>,
}

/// A checkpoint that could not be written; the run went on from the one
/// before.
#[derive(Clone, Debug, Serialize)]
pub struct CheckpointFailure {
    /// The step it was for.
    pub step: u64,
    /// Why, with the fix.
    pub cause: String,
}

/// The outcome of a run (memory figures are rank 0's; every rank's are
/// the same shape).
#[derive(Clone, Debug, Serialize)]
pub struct RunSummary {
    /// Steps run in this invocation.
    pub steps: u64,
    /// The first step's loss in this invocation.
    pub loss_first: f64,
    /// The last step's loss.
    pub loss_last: f64,
    /// Tokens per second over all ranks, excluding the first step (which
    /// also warms caches) when there is more than one.
    pub tokens_per_s: f64,
    /// Model-state bytes of one rank (bf16 params, fp32 grads, master
    /// weights and moments: 18 bytes per parameter of its shard).
    pub model_state_bytes: u64,
    /// Each tier's budget.
    pub budget_bytes: TierBytes,
    /// The most each tier held.
    pub peak_bytes: TierBytes,
    /// What the plans predicted.
    pub predicted_peak_bytes: TierBytes,
    /// The compute workspace held in device memory.
    pub workspace_bytes: u64,
    /// The host memory held for the state cache (`placement.state_cache`),
    /// in the host prediction.
    pub state_cache_bytes: u64,
    /// Blocks that recompute their forward in backward (rank 0):
    /// `train.checkpoint_activations`, or what "auto" chose.
    pub recomputed_blocks: usize,
    /// Bytes moved per link, in [`crate::Link`] order (host->nvme,
    /// nvme->host, host->device, device->host), rank 0.
    pub moved_bytes: [u64; 4],
    /// Time rank 0 waited on transfers.
    pub wait_s: f64,
    /// Every step's loss, in order.
    pub losses: Vec<f64>,
    /// Every step's report (rank 0; values are global): its loss, norm,
    /// clip coefficient, seconds and optimizer figures.
    pub reports: Vec<StepReport>,
    /// Checkpoints written.
    pub checkpoints: Vec<PathBuf>,
    /// Checkpoints that failed mid-run (the run went on).
    pub checkpoint_failures: Vec<CheckpointFailure>,
    /// The code of the [`StopRequest`] (the signal) that stopped the run
    /// early, if one did.
    pub stopped_by: Option<i32>,
    /// The last step run (counted from the start of training, resumed
    /// steps included).
    pub last_step: u64,
}

/// What a rank sends the caller after each step.
pub struct Progress<'a> {
    /// The step's report.
    pub report: &'a StepReport,
    /// Rank 0's runtime accounting after it.
    pub stats: &'a Stats,
    /// Seconds the checkpoint written after the step took, if one was.
    pub checkpoint_s: Option<f64>,
    /// Seconds a checkpoint is estimated to take, from a write of a probe
    /// file in the checkpoint directory before step 1 (None without one).
    pub checkpoint_estimate_s: Option<f64>,
}

/// Runs `config` on `corpus`, its `train.ranks` ranks threads of this
/// process, calling `progress` after every step.
pub fn run(
    config: &TrainConfig,
    corpus: &ByteCorpus,
    options: &RunOptions,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<RunSummary> {
    let summary = run_members(config, corpus, options, Members::Threads, progress)?;
    Ok(summary.expect("rank 0 reports"))
}

/// One rank of a run whose ranks are processes (launched by mpirun, srun
/// or torchrun): its member of the job's group, and the processes on its
/// machine.
pub struct ProcessRank {
    /// This process's member of the group of every rank.
    pub collective: Box<dyn Collective>,
    /// Ends the group's waits (the run's abort reaches them).
    pub cancel: Cancel,
    /// The job's processes on this machine, among which `host.budget` and
    /// `nvme.capacity` (per machine) are divided.
    pub local_world: usize,
    /// This process's place among them (which share of the cores it is
    /// bound to).
    pub local_rank: usize,
    /// Whether its launcher may have bound it to cores of its own (mpirun
    /// and srun do; torchrun and `--nproc` do not): a smaller affinity
    /// mask than the machine's is then taken as its share; otherwise the
    /// mask, however small, is divided among the machine's ranks.
    pub launcher_binds: bool,
}

/// Runs this process's rank of `config` (`train.ranks` 1 or the job's
/// processes): `host.budget` and `nvme.capacity` divided among the
/// machine's processes, the process bound to its own run of the machine's
/// cores (unless the launcher bound it), with `optim.threads = 0` the
/// optimizer's threads sized to that share and pinned within it, swap files under each `nvme.dirs` entry's
/// `rank{N}` (each rank locking its own), the checkpoint directory locked
/// by rank 0, whose `progress` hears of every step and who alone returns
/// the summary.
pub fn run_process(
    config: &TrainConfig,
    corpus: &ByteCorpus,
    options: &RunOptions,
    rank: ProcessRank,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Option<RunSummary>> {
    let world = rank.collective.world();
    if config.train.ranks != 1 && config.train.ranks != world {
        return Err(crate::error::bad(
            "train.ranks",
            config.train.ranks,
            format!(
                "the launcher started {world} processes, each one rank: set train.ranks = 1 or {world}"
            ),
        ));
    }
    let local = rank.local_world.max(1) as u64;
    let given = config;
    let mut config = machine_share(config, world, rank.local_rank, rank.local_world)?;
    use strata_optim::topology::{CpuTopology, bind_process, bound_to_a_share};
    let mut bound = rank.launcher_binds && bound_to_a_share();
    if !bound && local > 1 {
        match CpuTopology::detect().share(rank.local_rank, local as usize) {
            Some(cpus) => {
                bind_process(&cpus).map_err(|err| {
                    crate::error::os(
                        format!(
                            "bind local rank {} of {local} to CPUs {cpus:?}",
                            rank.local_rank
                        ),
                        err,
                        "run with fewer processes per machine, or bind them yourself (taskset, mpirun --bind-to core)",
                    )
                })?;
                tracing::info!(
                    "local rank {} of {local}: bound to CPUs {cpus:?}",
                    rank.local_rank
                );
                bound = true;
            }
            None => tracing::warn!(
                "{local} ranks on this machine and fewer cores than that: the ranks share the cores, an optimizer thread each"
            ),
        }
    }
    if config.optim.threads == 0 {
        // The engine divides the cores by its in-process ranks; a process
        // bound to a share of its own (here or by its launcher) takes that
        // share's; one sharing the cores with its machine's ranks, one
        // thread (pinned threads of several processes would share CPUs).
        let threads = match bound || local == 1 {
            true => super::optimizer::default_threads(CpuTopology::detect().core_count(), 1),
            false => 1,
        };
        config.optim.threads = u32::try_from(threads).unwrap_or(u32::MAX);
    }
    let given = TrainConfig {
        train: super::TrainSettings {
            ranks: world,
            ..given.train.clone()
        },
        ..given.clone()
    };
    let member = Box::new((rank.collective, rank.cancel, given));
    run_members(&config, corpus, options, Members::Process(member), progress)
}

/// `config` as one of `local_world` processes of a machine runs it, of a
/// job of `world`: the machine's `host.budget` and `nvme.capacity`
/// divided among them, and its GPU the local rank's (`device.ordinal`,
/// which a config may then not set).
fn machine_share(
    config: &TrainConfig,
    world: usize,
    local_rank: usize,
    local_world: usize,
) -> Result<TrainConfig> {
    let local = local_world.max(1);
    let mut config = config.clone();
    config.train.ranks = world;
    config.host.budget.0 /= local as u64;
    if let Some(nvme) = config.nvme.as_mut() {
        nvme.capacity.0 /= local as u64;
    }
    if local > 1 {
        if config.device.ordinal != 0 {
            return Err(crate::error::bad(
                "device.ordinal",
                config.device.ordinal,
                format!(
                    "{local} processes share this machine, and each takes the GPU of its local rank: leave device.ordinal unset (or set CUDA_VISIBLE_DEVICES)"
                ),
            ));
        }
        config.device.ordinal = local_rank;
    }
    Ok(config)
}

/// The most elements one exchange of a run of `config` over `world` ranks
/// (its states sharded over `config.shards()` of them) carries: what a
/// process's collective is sized for.
pub fn collective_elems_max(config: &TrainConfig, world: usize) -> Result<usize> {
    Ok(super::tensors::collective_elems_max(
        &*config.model.build()?,
        world,
        config.shards(),
    ))
}

/// Where a run's ranks are.
enum Members {
    /// Every rank a thread of this process (`train.ranks` of them).
    Threads,
    /// This process is one rank of a job, and the run's config as its
    /// checkpoints record it (the machine's budgets, not the process's).
    Process(Box<(Box<dyn Collective>, Cancel, TrainConfig)>),
}

/// [`run`] and [`run_process`]: the checks, then each member of this
/// process on its own thread.
fn run_members(
    config: &TrainConfig,
    corpus: &ByteCorpus,
    options: &RunOptions,
    members: Members,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Option<RunSummary>> {
    // The ranks this process runs.
    let process_rank = match &members {
        Members::Threads => None,
        Members::Process(member) => Some(member.0.rank()),
    };
    config.validate()?;
    corpus.check_vocab(config.model.vocab)?;
    for (what, corpus) in [("data", Some(corpus)), ("eval", options.eval.as_ref())] {
        if let Some(corpus) = corpus {
            check_documents(config, what, corpus)?;
        }
    }
    match (&options.eval, config.eval.every) {
        (None, every) if every > 0 => {
            return Err(crate::error::bad(
                "eval.every",
                every,
                "open the held-out data of eval.path (as the training data is) and pass it as RunOptions::eval",
            ));
        }
        (Some(eval), _) => eval.check_vocab(config.model.vocab)?,
        _ => {}
    }
    // The starting weights, checked before anything is planned or written;
    // a resumed run takes its weights from the checkpoint instead.
    let resumed;
    let config = if options.resume.is_some() {
        resumed = TrainConfig {
            model: crate::ModelConfig {
                init_from: None,
                ..config.model.clone()
            },
            ..config.clone()
        };
        &resumed
    } else {
        drop(config.check_init_from()?);
        config
    };
    let world = config.train.ranks;
    // Counted again with the device known (the gradients' width follows it).
    let resolved = config.with_device_resolved().0;
    if resolved != *config {
        resolved.validate()?;
    }
    if let Members::Threads = members {
        resolved.gpu_ranks_as_threads()?;
    }
    // Refused before any directory is taken or file written.
    let resume = match &options.resume {
        Some(path) => {
            let checkpoint = Checkpoint::open(path)?;
            check_resumed_run(config, &checkpoint)?;
            match &checkpoint.meta.data {
                Some(saved) => corpus.check_position(saved, &checkpoint.dir)?,
                // Written before the epoch order: its run drew random
                // windows by step, which only the random order goes on with.
                None if config.data.order != super::DataOrder::Random => {
                    return Err(TrainError::Checkpoint {
                        path: checkpoint.dir.clone(),
                        problem: "it records no place in the data: its run drew random windows by step, before the epoch order".into(),
                        fix: "resume it with [data] order = \"random\" (as `strata train --resume DIR` alone does when the checkpoint holds its config)".into(),
                    });
                }
                None => {}
            }
            Some(checkpoint)
        }
        None => None,
    };
    let _owned = own_directories(config, options, process_rank)?;
    // Rank 0's directory to probe (another process's rank waits for it).
    let checkpoint_estimate_s = match &config.train.checkpoint_dir {
        Some(dir) if process_rank.is_none_or(|r| r == 0) => {
            Some(estimate_checkpoint_s(config, dir)?)
        }
        _ => None,
    };
    // Budgets the machine cannot give, refused before anything is
    // allocated (the device `auto` resolves to decides which memory).
    resolved.check_machine()?;
    let (members, recorded): (Vec<(Box<dyn Collective>, Cancel)>, _) = match members {
        // Ranks as threads: the in-process group, the one place that
        // names it.
        Members::Threads => (
            InProcess::group(
                world,
                super::tensors::collective_elems_max(
                    &*config.model.build()?,
                    world,
                    config.shards(),
                ),
            )
            .into_iter()
            .map(|member| {
                let cancel = member.cancel_token();
                (Box::new(member) as Box<dyn Collective>, cancel)
            })
            .collect::<Vec<_>>(),
            None,
        ),
        Members::Process(member) => {
            let (collective, cancel, given) = *member;
            (vec![(collective, cancel)], Some(given))
        }
    };
    let recorded = recorded.as_ref();
    let (sender, receiver) = channel::<(StepReport, Stats, Option<f64>)>();
    let stop = options
        .stop_after
        .unwrap_or(config.train.steps)
        .min(config.train.steps);
    if let Some(checkpoint) = &resume {
        if checkpoint.meta.step >= stop {
            return Err(TrainError::Checkpoint {
                path: checkpoint.dir.clone(),
                problem: format!(
                    "it is at step {}, and this run stops at step {stop}: the run is finished",
                    checkpoint.meta.step
                ),
                fix: match options.stop_after {
                    Some(at) if at < config.train.steps => {
                        format!(
                            "give a --stop-after above {} (or none)",
                            checkpoint.meta.step
                        )
                    }
                    _ => "raise train.steps (or --steps) to train further from it".into(),
                },
            });
        }
        // Every file, the weights included, before any rank starts.
        checkpoint.verify()?;
        tracing::info!(
            "resumed from step {} of {} ({})",
            checkpoint.meta.step,
            config.train.steps,
            checkpoint.dir.display()
        );
    }
    // The trace file is created now, so an unwritable path fails before
    // step 1 rather than after the run.
    let mut trace = match options
        .trace
        .as_ref()
        .filter(|_| process_rank.is_none_or(|r| r == 0))
    {
        Some(path) => Some((
            path.clone(),
            std::fs::File::create(path).map_err(|err| {
                os(
                    format!("create the --trace file {}", path.display()),
                    err,
                    "choose a writable path for --trace",
                )
            })?,
        )),
        None => None,
    };
    std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(world);
        for (collective, cancel) in members {
            let rank = collective.rank();
            let sender = sender.clone();
            let resume = resume.clone();
            let trace = if rank == 0 { trace.take() } else { None };
            handles.push(
                std::thread::Builder::new()
                    .name(format!("strata-rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        rank_main(
                            (config, recorded),
                            (corpus, options.eval.as_ref()),
                            (collective, cancel),
                            resume,
                            trace,
                            (stop, &options.stop, options.faults),
                            sender,
                        )
                    })
                    .map_err(|err| {
                        os(
                            format!("start the thread of rank {rank} of {world}"),
                            err,
                            "use fewer train.ranks or raise the thread limit (ulimit -u)",
                        )
                    }),
            );
        }
        drop(sender);
        for (report, stats, checkpoint_s) in receiver {
            progress(Progress {
                report: &report,
                stats: &stats,
                checkpoint_s,
                checkpoint_estimate_s,
            });
        }
        let (outcomes, first_error) = join_ranks(handles);
        let summary = outcomes.into_iter().flatten().next();
        match (first_error, options.stop.aborted()) {
            // Waits cut short by the abort, and ranks leaving because of
            // them, are one cause: the abort.
            (Some(err), Some(code)) if err.is_cancelled() || err.is_peer_left() => {
                Err(TrainError::Aborted { code })
            }
            (Some(err), _) => Err(err),
            (None, _) => Ok(summary),
        }
    })
}

/// Ranks that are processes, perhaps on several machines, write one
/// checkpoint directory: a file rank 0 writes there (named by a run id it
/// makes and every rank receives) must be seen by every rank, or the run
/// stops before its first step saying why. Every rank calls it together.
fn check_shared_dir(engine: &Engine, dir: &std::path::Path) -> Result<()> {
    let rank = engine.env.rank();
    let made = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    // Exact in an f64 sum: 52 bits of rank 0's, zeros from the others.
    let mut id = [match rank {
        0 => ((made ^ u64::from(std::process::id()) << 32) & ((1 << 52) - 1)) as f64,
        _ => 0.0,
    }];
    engine.env.collective().all_reduce_scalars(&mut id)?;
    let probe = dir.join(format!(".strata-shared-{:013x}", id[0] as u64));
    if rank == 0 {
        std::fs::write(&probe, b"strata: every rank must see this file\n").map_err(|err| {
            os(
                format!("write {}", probe.display()),
                err,
                "choose a writable train.checkpoint_dir",
            )
        })?;
    }
    engine.any_rank(false)?;
    let unseen = !probe.exists();
    let any_unseen = engine.any_rank(unseen)?;
    engine.any_rank(false)?;
    if rank == 0 {
        let _ = std::fs::remove_file(&probe);
    }
    if any_unseen {
        return Err(TrainError::Ownership {
            what: "train.checkpoint_dir".into(),
            dir: dir.to_path_buf(),
            problem: match unseen {
                true => format!("rank {rank} does not see the file rank 0 wrote there"),
                false => "a rank does not see the file rank 0 wrote there".into(),
            },
            fix: "give a directory on a file system every rank's machine shares (NFS, Lustre, ...): each rank writes its optimizer shard there".into(),
        });
    }
    Ok(())
}

/// Refuses `corpus` (the `what` data) when the config keeps documents
/// apart and it tells none apart, or its end of documents is no token.
fn check_documents(config: &TrainConfig, what: &str, corpus: &Corpus) -> Result<()> {
    match corpus.documents_end() {
        None if config.data.attention == super::DataAttention::Document => {
            return Err(crate::error::bad(
                "data.attention",
                "\"document\"",
                format!(
                    "the {what} corpus tells no documents apart: set data.eos_id (Corpus::open reads it), or call Corpus::with_documents with the end-of-document id"
                ),
            ));
        }
        Some(eos) if eos as usize >= config.model.vocab => {
            return Err(crate::error::bad(
                "data.eos_id",
                eos,
                format!(
                    "the end-of-document id must be a token of the model's vocabulary of {}",
                    config.model.vocab
                ),
            ));
        }
        _ => {}
    }
    Ok(())
}

/// Every rank's outcome, joined in rank order: what the ranks that ended
/// well returned, and the first error that is a cause rather than a
/// consequence (a rank stopped by another's failure, or by an abort,
/// reports that only if nothing better comes).
fn join_ranks<T>(
    handles: Vec<Result<std::thread::ScopedJoinHandle<'_, Result<T>>>>,
) -> (Vec<T>, Option<TrainError>) {
    let mut done = Vec::with_capacity(handles.len());
    let mut first_error: Option<TrainError> = None;
    for (rank, handle) in handles.into_iter().enumerate() {
        let outcome = match handle {
            Ok(handle) => handle.join().unwrap_or_else(|_| {
                Err(TrainError::Rank {
                    rank,
                    cause: "it panicked".into(),
                })
            }),
            Err(err) => Err(err),
        };
        match outcome {
            Ok(value) => done.push(value),
            Err(err) if err.is_peer_left() || err.is_cancelled() => {
                first_error.get_or_insert(err);
            }
            Err(err) => {
                if first_error
                    .as_ref()
                    .is_none_or(|e| e.is_peer_left() || e.is_cancelled())
                {
                    first_error = Some(err);
                }
            }
        }
    }
    (done, first_error)
}

/// Evaluates the model of `config` over the first `windows_max` windows
/// of `corpus` (all of them without it), forward only, with its
/// parameters placed as a run of `config` places them: `train.ranks` ranks
/// as threads, each an [`Engine`] taking its weights from `checkpoint`
/// (resumed, its exact master weights, when it has as many ranks and
/// states as wide; else the weights it publishes), else from
/// `model.init_from`'s folder, streamed into their tiers (else the seed's
/// initialization). No checkpoint directory is taken; the swap
/// directories are locked as a run locks them. `progress` hears rank 0's
/// windows done.
pub fn evaluate(
    config: &TrainConfig,
    checkpoint: Option<&Checkpoint>,
    corpus: &Corpus,
    windows_max: Option<u64>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Evaluation> {
    let mut config = config.clone();
    config.train.checkpoint_dir = None;
    // A checkpoint of as many ranks and states of the same width is
    // resumed (its exact master weights, the seeds a resume checks taken
    // from it); another is read from the weights it publishes, in
    // `checkpoint.weights_dtype`, as a Hugging Face folder.
    let resumed = checkpoint.filter(|c| {
        c.meta.ranks == config.shards() && c.meta.state_dtype == config.optim.state_dtype
    });
    match (checkpoint, resumed) {
        (_, Some(checkpoint)) => {
            config.model.init_from = None;
            config.train.seed = checkpoint.meta.seed;
            config.optim.rounding_seed = checkpoint.meta.rounding_seed;
        }
        (Some(checkpoint), None) => {
            tracing::info!(
                "{}: written by {} ranks with {} states, evaluated by {} with {}: its published weights are read",
                checkpoint.dir.display(),
                checkpoint.meta.ranks,
                checkpoint.meta.state_dtype.name(),
                config.train.ranks,
                config.optim.state_dtype.name()
            );
            config.model.init_from = Some(checkpoint.dir.clone());
        }
        (None, None) => {}
    }
    config.validate()?;
    corpus.check_vocab(config.model.vocab)?;
    check_documents(&config, "eval", corpus)?;
    match resumed {
        Some(checkpoint) => drop(checkpoint.verify()?),
        None => drop(config.check_init_from()?),
    }
    let config = &config;
    let resolved = config.with_device_resolved().0;
    if resolved != *config {
        resolved.validate()?;
    }
    let _owned = own_directories(config, &RunOptions::default(), None)?;
    resolved.check_machine()?;
    let world = config.train.ranks;
    // Ranks as threads: the in-process group, as a run's.
    let collectives = InProcess::group(
        world,
        super::tensors::collective_elems_max(&*config.model.build()?, world, config.shards()),
    );
    std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(world);
        for collective in collectives {
            let rank = collective.rank();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("strata-eval-rank-{rank}"))
                    .spawn_scoped(scope, move || -> Result<Evaluation> {
                        let mut engine = Engine::new(config, Box::new(collective))?;
                        if let Some(checkpoint) = resumed {
                            engine.resume(checkpoint)?;
                        }
                        let quiet = |_| {};
                        let told: &dyn Fn(u64) = if rank == 0 { progress } else { &quiet };
                        engine.evaluate(corpus, windows_max, told)
                    })
                    .map_err(|err| {
                        os(
                            format!("start the thread of rank {rank} of {world}"),
                            err,
                            "use fewer train.ranks or raise the thread limit (ulimit -u)",
                        )
                    }),
            );
        }
        match join_ranks(handles) {
            (_, Some(err)) => Err(err),
            (mut done, None) => Ok(done.swap_remove(0)),
        }
    })
}

/// Refuses a resumed run that would compute another run than the one its
/// checkpoint comes from (its config, [`crate::RUN_CONFIG`], against this
/// one's), every differing key named with both values; a longer
/// `train.steps` may extend a run that finished, and says so.
fn check_resumed_run(config: &TrainConfig, checkpoint: &Checkpoint) -> Result<()> {
    let Some(saved) = checkpoint.run_config()? else {
        return Ok(());
    };
    let step = checkpoint.meta.step;
    let (finished, longer) = (
        step >= saved.train.steps,
        config.train.steps > saved.train.steps,
    );
    let differences: Vec<String> = config
        .resume_differences(&saved)
        .into_iter()
        .filter(|d| !(d.key == "train.steps" && finished && longer))
        .map(|d| d.to_string())
        .collect();
    if !differences.is_empty() {
        return Err(TrainError::Checkpoint {
            path: checkpoint.dir.join(crate::RUN_CONFIG),
            problem: format!(
                "resuming would change the run it comes from: {}",
                differences.join("; ")
            ),
            fix: format!(
                "resume without the flags or config keys that change it (`strata train --resume {}` \
                 alone continues the run as it was; --steps may only extend a finished run), or \
                 start a new run from its weights with --init-from {}",
                checkpoint.dir.display(),
                checkpoint.dir.display()
            ),
        });
    }
    if finished && longer {
        use crate::engine::config::Schedule;
        if let Schedule::WarmupDecayLr {
            total_num_steps: Some(end),
            ..
        }
        | Schedule::WarmupCosineLr {
            total_num_steps: Some(end),
            ..
        } = config.train.schedule
            && end < config.train.steps
        {
            tracing::warn!(
                "train.schedule.total_num_steps = {end} ends before the extended run's {} steps: the steps past it run at the schedule's final rate; set total_num_steps to extend the schedule too",
                config.train.steps
            );
        }
        tracing::warn!(
            "train.steps = {}: extending the run, which finished at step {step}, by {} steps; \
             the learning-rate schedule now spans {} steps (step {} runs at lr {:.3e})",
            config.train.steps,
            config.train.steps - step,
            config.train.steps,
            step + 1,
            config.train.lr_at(step + 1)
        );
    }
    Ok(())
}

/// One rank of a run over `collective`, whatever its backend; `cancel`
/// ends the collective's waits (registered with the run's stop request,
/// so an abort reaches them).
fn rank_main(
    (config, recorded): (&TrainConfig, Option<&TrainConfig>),
    (corpus, eval): (&ByteCorpus, Option<&Corpus>),
    (collective, cancel): (Box<dyn Collective>, Cancel),
    resume: Option<Checkpoint>,
    trace: Option<(PathBuf, std::fs::File)>,
    (stop, request, faults): (u64, &StopRequest, Option<super::Faults>),
    sender: std::sync::mpsc::Sender<(StepReport, Stats, Option<f64>)>,
) -> Result<Option<RunSummary>> {
    let rank = collective.rank();
    let world = collective.world();
    request.watch(cancel);
    let mut engine = Engine::with_faults(config, collective, faults)?;
    request.watch(engine.runtime().cancel_token());
    // A process's rank: its checkpoints record the run's config, and the
    // ranks must share the checkpoint directory.
    if let Some(given) = recorded {
        engine.record_run_config(given)?;
        if let Some(dir) = &config.train.checkpoint_dir {
            check_shared_dir(&engine, dir)?;
        }
    }
    if let Some(checkpoint) = &resume {
        engine.resume(checkpoint)?;
    }
    let t = &config.train;
    // Sequences read before the next step: the checkpoint's record, or
    // (a checkpoint from before it, in the random order) its steps' worth.
    let samples = resume.as_ref().map_or(0, |checkpoint| {
        checkpoint.meta.data.as_ref().map_or(
            checkpoint.meta.step * t.sequences_per_step() as u64,
            |data| data.samples,
        )
    });
    let mut data = DataReader::new(
        corpus,
        config.data.order,
        t.seed,
        (rank, world),
        t.grad_accumulation,
        t.micro_batch,
        samples,
    );
    let mut tokens = vec![0u32; engine.tokens_per_step()];
    let mut reports = Vec::new();
    let mut checkpoints = Vec::new();
    let mut timed = (0.0f64, 0u64);
    let mut failures = Vec::new();
    let mut stopped_by = None;
    while engine.steps_done() < stop {
        let step = engine.steps_done() + 1;
        data.step_tokens(step, &mut tokens);
        let started = Instant::now();
        let mut report = engine.step(&tokens).map_err(|e| e.in_step(step))?;
        if let Some(eval) = eval.filter(|_| config.eval.due(step, stop)) {
            // Every rank evaluates its slice with the parameters where
            // they train; the passes are spans of the trace.
            let result = engine
                .evaluate(eval, Some(config.eval.windows), &|_| {})
                .map_err(|e| e.in_step(step))?;
            report.eval_loss = Some(result.loss);
        }
        if !reports.is_empty() || stop == engine.steps_done() {
            timed.0 += started.elapsed().as_secs_f64();
            timed.1 += report.tokens;
        }
        // Every rank stops at the same boundary: the first to see the
        // request tells the others.
        if engine
            .any_rank(request.requested().is_some())
            .map_err(|e| e.in_step(step))?
        {
            stopped_by = Some(request.requested().unwrap_or(STOPPED_BY_PEER));
        }
        let mut checkpoint_s = None;
        if let Some(dir) = &t.checkpoint_dir {
            let due = t.checkpoint_every > 0 && step % t.checkpoint_every == 0;
            let last = step == stop || stopped_by.is_some();
            if due || last {
                let started = Instant::now();
                let saved = engine
                    .try_save_checkpoint(dir, Some(&data.position()))
                    .map_err(|e| e.in_step(step))?;
                checkpoint_s = Some(started.elapsed().as_secs_f64());
                match saved {
                    Ok(path) => checkpoints.push(path),
                    // The last checkpoint is the run's result: its
                    // failure is the run's.
                    Err(err) if last => return Err(err),
                    Err(err) => {
                        if rank == 0 {
                            tracing::warn!(
                                "the checkpoint of step {step} was not written, and training goes on from {}: {err}",
                                checkpoints.last().map_or_else(
                                    || "the start (no checkpoint yet)".to_string(),
                                    |p: &PathBuf| p.display().to_string()
                                )
                            );
                        }
                        failures.push(CheckpointFailure {
                            step,
                            cause: err.to_string(),
                        });
                    }
                }
            }
        }
        if rank == 0 {
            let _ = sender.send((report.clone(), engine.runtime().stats(), checkpoint_s));
        }
        reports.push(report);
        if stopped_by.is_some() {
            break;
        }
    }
    if rank != 0 {
        return Ok(None);
    }
    if let Some((path, mut file)) = trace {
        engine.runtime().write_trace(&mut file).map_err(|err| {
            os(
                format!("write the --trace file {}", path.display()),
                err,
                "free space on that disk or choose another path for --trace",
            )
        })?;
    }
    let stats = engine.runtime().stats();
    let prediction = engine.prediction();
    let mut peak = [0, 1, 2].map(|i| stats.tiers[i].peak_bytes);
    peak[Tier::Device.index()] += prediction.workspace_bytes;
    let mut budget = [0, 1, 2].map(|i| stats.tiers[i].budget_bytes);
    budget[Tier::Device.index()] += prediction.workspace_bytes;
    Ok(Some(RunSummary {
        steps: reports.len() as u64,
        loss_first: reports.first().map_or(f64::NAN, |r| r.loss),
        loss_last: reports.last().map_or(f64::NAN, |r| r.loss),
        tokens_per_s: if timed.0 > 0.0 {
            timed.1 as f64 / timed.0
        } else {
            0.0
        },
        model_state_bytes: engine.model_state_bytes(),
        budget_bytes: TierBytes::from_array(budget),
        peak_bytes: TierBytes::from_array(peak),
        predicted_peak_bytes: TierBytes::from_array(prediction.peak_bytes),
        workspace_bytes: prediction.workspace_bytes,
        state_cache_bytes: prediction.state_cache_bytes,
        recomputed_blocks: prediction.recomputed_blocks,
        moved_bytes: [0, 1, 2, 3].map(|i| stats.links[i].bytes),
        wait_s: stats.wait_ns as f64 / 1e9,
        losses: reports.iter().map(|r| r.loss).collect(),
        last_step: engine.steps_done(),
        reports,
        checkpoints,
        checkpoint_failures: failures,
        stopped_by,
    }))
}

/// Bytes of one checkpoint, with 5% to spare: the fp32 weights (4 bytes
/// per parameter) and every rank's shard of master weights and moments
/// (12 bytes per parameter in all).
fn checkpoint_bytes(params: u64) -> u64 {
    params
        .saturating_mul(16)
        .saturating_add(params.saturating_mul(16) / 20)
}

/// The largest probe [`estimate_checkpoint_s`] writes.
const PROBE_BYTES_MAX: u64 = 64 << 20;

/// Seconds one checkpoint should take to write in `dir`, from the time a
/// probe file (the checkpoint's size, at most [`PROBE_BYTES_MAX`]) takes
/// to write and fsync there; the probe is removed. Logged at start, so
/// that a scheduler's grace period can be checked before step 1.
fn estimate_checkpoint_s(config: &TrainConfig, dir: &std::path::Path) -> Result<f64> {
    use std::io::Write;
    let needed = checkpoint_bytes(config.model.build()?.params() as u64);
    let probe_bytes = needed.clamp(1 << 20, PROBE_BYTES_MAX);
    let path = dir.join(format!(".strata-write-probe-{}", std::process::id()));
    let failed = |err| {
        os(
            format!(
                "write a probe file in train.checkpoint_dir {}",
                path.display()
            ),
            err,
            "choose a writable checkpoint directory with room for a checkpoint",
        )
    };
    let chunk = vec![0x5au8; 1 << 20];
    let started = Instant::now();
    let written = std::fs::File::create(&path).and_then(|mut file| {
        for _ in 0..probe_bytes >> 20 {
            file.write_all(&chunk)?;
        }
        file.sync_all()
    });
    let took = started.elapsed().as_secs_f64().max(1e-6);
    let removed = std::fs::remove_file(&path);
    written.map_err(failed)?;
    removed.map_err(failed)?;
    let rate = probe_bytes as f64 / took;
    let estimate = needed as f64 / rate;
    tracing::info!(
        "a checkpoint of {:.1} MiB should take about {estimate:.1} s: {} wrote and synced a {} MiB probe at {:.0} MB/s",
        needed as f64 / f64::from(1 << 20),
        dir.display(),
        probe_bytes >> 20,
        rate / 1e6
    );
    Ok(estimate)
}

/// Errors unless `dir`'s filesystem has room for one checkpoint
/// ([`checkpoint_bytes`]).
fn check_checkpoint_room(config: &TrainConfig, dir: &std::path::Path) -> Result<()> {
    let params = config.model.build()?.params() as u64;
    let needed = checkpoint_bytes(params);
    let available = strata_storage::sys::available_bytes(dir).map_err(|err| {
        os(
            format!(
                "read the free space of train.checkpoint_dir {}",
                dir.display()
            ),
            err,
            "choose another checkpoint directory",
        )
    })?;
    if available < needed {
        return Err(TrainError::Checkpoint {
            path: dir.to_path_buf(),
            problem: format!(
                "its filesystem has {available} bytes free, and one checkpoint of this model needs about {needed} ({params} parameters x 16 bytes, plus 5%)"
            ),
            fix: "free space there or choose another train.checkpoint_dir".into(),
        });
    }
    Ok(())
}

/// Locks the run's checkpoint directory and swap directories for its
/// life (see [`super::ownership`]), and refuses a checkpoint directory
/// that already holds checkpoints unless the run resumes or overwrites.
///
/// A rank that is a process (`process_rank`) locks its own `rank{N}`
/// subdirectory of each swap directory, and only rank 0 the checkpoint
/// directory.
fn own_directories(
    config: &TrainConfig,
    options: &RunOptions,
    process_rank: Option<usize>,
) -> Result<Vec<DirLock>> {
    let holder = Holder::this_run();
    let wait = Duration::from_secs_f64(config.train.lock_wait_s);
    let lock_dir = |dir: &Path, what: &str| {
        // Made here first, so that a directory that cannot be made is the
        // OS's error with the path (the lock would say the same less plainly).
        super::durable::create_dir_all_durably(&super::durable::RealFs, dir).map_err(|err| {
            os(
                format!("create {what} {}", dir.display()),
                err,
                "choose a writable directory",
            )
        })?;
        let wait = LockWait {
            wait,
            setting: "train.lock_wait_s",
        };
        strata_storage::lock_dir(dir, what, &holder, wait).map_err(|err| match err {
            StorageError::Ownership {
                what,
                dir,
                problem,
                fix,
            } => TrainError::Ownership {
                what,
                dir,
                problem,
                fix,
            },
            other => TrainError::from(other),
        })
    };
    let mut owned = Vec::new();
    let checkpoints = config
        .train
        .checkpoint_dir
        .as_ref()
        .filter(|_| process_rank.is_none_or(|r| r == 0));
    if let Some(dir) = checkpoints {
        owned.push(lock_dir(dir, "train.checkpoint_dir")?);
        check_checkpoint_room(config, dir)?;
        // `latest` decides, even when what it names cannot be read: a
        // damaged checkpoint is still another run's.
        if dir.join("latest").exists() && options.resume.is_none() && !options.overwrite {
            let latest = Checkpoint::open(dir).map_or_else(
                |_| "unreadable".to_string(),
                |c| format!("step {}", c.meta.step),
            );
            return Err(TrainError::Ownership {
                what: "train.checkpoint_dir".into(),
                dir: dir.clone(),
                problem: format!(
                    "it holds another run's checkpoints (latest: {latest}), which a new run would mix with its own"
                ),
                fix: format!(
                    "resume it with --resume {}, pass --overwrite to start over there, or choose another directory",
                    dir.display()
                ),
            });
        }
    }
    if let Some(nvme) = config.nvme.as_ref().filter(|_| config.uses_nvme()) {
        for dir in &nvme.dirs {
            if !nvme.create_dirs && !dir.is_dir() {
                return Err(TrainError::Ownership {
                    what: "nvme.dirs entry".into(),
                    dir: dir.clone(),
                    problem: format!(
                        "it does not exist (or is not a directory), and strata does not create a swap directory a config names{}",
                        // A config whose [nvme] section leaves dirs out names it too.
                        if nvme.dirs == strata_storage::StorageConfig::default().dirs {
                            " (nvme.dirs defaults to this one when the config leaves it out)"
                        } else {
                            ""
                        }
                    ),
                    fix: format!(
                        "create it on the drive to swap to (mkdir -p {}), fix the path, or set nvme.create_dirs = true",
                        dir.display()
                    ),
                });
            }
            match process_rank {
                None => owned.push(lock_dir(dir, "nvme.dirs entry")?),
                Some(rank) => {
                    // The rank's own swap subdirectory (the runtime's).
                    let own = dir.join(format!("rank{rank}"));
                    std::fs::create_dir_all(&own).map_err(|err| {
                        os(
                            format!("create the swap directory {}", own.display()),
                            err,
                            "choose a writable directory in nvme.dirs",
                        )
                    })?;
                    owned.push(lock_dir(&own, "nvme.dirs entry")?);
                }
            }
        }
    }
    Ok(owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_storage::ByteSize;

    #[test]
    fn a_machines_processes_share_its_budgets_and_each_takes_its_own_gpu() {
        let mut config = TrainConfig::default();
        config.host.budget = ByteSize(8 << 30);
        let capacity = config.nvme.as_ref().map(|n| n.capacity.0).unwrap();
        let share = machine_share(&config, 4, 1, 2).unwrap();
        assert_eq!(share.train.ranks, 4);
        assert_eq!(share.host.budget.0, 4 << 30);
        assert_eq!(share.nvme.unwrap().capacity.0, capacity / 2);
        assert_eq!(share.device.ordinal, 1, "local rank 1's GPU");
        // Alone on its machine: the config's own GPU.
        config.device.ordinal = 3;
        assert_eq!(machine_share(&config, 2, 0, 1).unwrap().device.ordinal, 3);
        let err = machine_share(&config, 4, 0, 2).unwrap_err().to_string();
        assert!(
            err.contains("device.ordinal") && err.contains("local rank"),
            "{err}"
        );
    }
}
