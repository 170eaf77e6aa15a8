//! What every part of the engine reads and none writes: the run's config,
//! the architecture, the parameter groups, the rank's runtime, the compute
//! backend and the collective group. Opened once by [`Env::open`]; the
//! parts borrow it for each call.

use std::sync::Arc;

use strata_comm::Collective;
use strata_kernels::{Backend, CpuBackend};
use strata_runtime::Runtime;

use crate::error::{Result, TrainError, bad, os};
use crate::model::{self, Model};

use super::config::TrainConfig;
use super::tensors::{Group, groups};

/// The rank's read-only surroundings.
///
/// The groups come first, so they are dropped first: an NCCL group
/// flushes or aborts its work on the GPU before the runtime's device waits
/// for the context's streams.
pub(super) struct Env {
    /// With hybrid sharding (`parallel.shard_degree` below the ranks):
    /// this rank's shard group (the neighbouring ranks its states are
    /// sharded over) and its replica group (the ranks holding the same
    /// shard as it, one per shard group).
    hybrid: Option<(Box<dyn Collective>, Box<dyn Collective>)>,
    collective: Box<dyn Collective>,
    config: TrainConfig,
    model: Arc<dyn Model>,
    groups: Arc<Vec<Group>>,
    runtime: Arc<Runtime>,
    backend: Box<dyn Backend>,
}

/// What [`Env::open`] opens before the runtime: the compute backend, the
/// GPU context it computes on (none on the CPU device), the device bytes
/// it holds, and the config with `device.kind` resolved.
pub(super) struct Compute {
    pub(super) backend: Box<dyn Backend>,
    pub(super) context: Option<Arc<strata_device::cuda::Context>>,
    pub(super) backend_bytes: u64,
    pub(super) config: TrainConfig,
    pub(super) model: Arc<dyn Model>,
    pub(super) groups: Arc<Vec<Group>>,
}

impl Env {
    /// The backend `config` resolves to for rank `collective.rank()`, with
    /// the architecture and its groups: checks the world size, and with
    /// `auto` falls back to the CPU device when the GPU's backend does not
    /// open (said once).
    pub(super) fn compute(config: &TrainConfig, collective: &dyn Collective) -> Result<Compute> {
        let (world, rank) = (collective.world(), collective.rank());
        if world != config.train.ranks {
            return Err(bad(
                "train.ranks",
                config.train.ranks.to_string(),
                format!("the collective group has {world} ranks: make them agree"),
            ));
        }
        let model: Arc<dyn Model> = model::build(&config.model)?.into();
        let shards = config.shards();
        let groups = Arc::new(groups(&*model, shards, rank % shards));
        let tokens = config.train.micro_batch * model.seq();
        // `auto`: the GPU if one answers and its backend opens (a driver
        // alone, an architecture strata does not compile for or a missing
        // library leave the CPU device), said once.
        let auto = config.device.kind == strata_runtime::DeviceChoice::Auto;
        let (mut resolved, mut why_not_gpu) = config.with_device_resolved();
        let (backend, context, backend_bytes) = match open_backend(&resolved, tokens) {
            Err(err) if auto && resolved.device.kind == strata_runtime::DeviceChoice::Cuda => {
                why_not_gpu = Some(err.to_string());
                resolved.device.kind = strata_runtime::DeviceChoice::Cpu;
                open_backend(&resolved, tokens)?
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
        Ok(Compute {
            backend,
            context,
            backend_bytes,
            config: resolved,
            model,
            groups,
        })
    }

    /// The surroundings once the runtime is open; on GPUs, the group's
    /// NCCL communicator, built over `collective` (which keeps the host
    /// operands and the scalar sums); with hybrid sharding, the shard and
    /// replica groups split from it (every rank splits them together).
    pub(super) fn new(
        compute: Compute,
        runtime: Arc<Runtime>,
        collective: Box<dyn Collective>,
    ) -> Result<Env> {
        let (world, rank, shards) = (
            collective.world(),
            collective.rank(),
            compute.config.shards(),
        );
        let collective = match &compute.context {
            Some(context) if world > 1 => nccl_over(&compute, context, collective)?,
            _ => collective,
        };
        let hybrid = match shards < world {
            false => None,
            true => {
                let first = rank / shards * shards;
                let shard: Vec<usize> = (first..first + shards).collect();
                let replicas: Vec<usize> = (rank % shards..world).step_by(shards).collect();
                Some((collective.split(&shard)?, collective.split(&replicas)?))
            }
        };
        Ok(Env {
            config: compute.config,
            model: compute.model,
            groups: compute.groups,
            runtime,
            backend: compute.backend,
            collective,
            hybrid,
        })
    }

    /// Ranks this rank's model states are sharded over.
    pub(super) fn shards(&self) -> usize {
        self.config.shards()
    }

    /// This rank's place among them: which shard of each group it holds.
    pub(super) fn shard_rank(&self) -> usize {
        self.rank() % self.shards()
    }

    /// Which copy of the shards this rank's group holds (0 without
    /// hybrid sharding): copy 0 writes the checkpoints' states.
    pub(super) fn replica(&self) -> usize {
        self.rank() / self.shards()
    }

    /// The group the states are sharded over: every rank, or this rank's
    /// shard group.
    pub(super) fn shard_group(&self) -> &dyn Collective {
        match &self.hybrid {
            Some((shard, _)) => &**shard,
            None => &*self.collective,
        }
    }

    /// The ranks holding the same shards as this one, with hybrid
    /// sharding.
    pub(super) fn replicas(&self) -> Option<&dyn Collective> {
        self.hybrid.as_ref().map(|(_, replicas)| &**replicas)
    }

    pub(super) fn config(&self) -> &TrainConfig {
        &self.config
    }

    pub(super) fn model(&self) -> &dyn Model {
        &*self.model
    }

    /// The parameter groups and this rank's shard of each.
    pub(super) fn groups(&self) -> &Arc<Vec<Group>> {
        &self.groups
    }

    pub(super) fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    pub(super) fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    pub(super) fn collective(&self) -> &dyn Collective {
        &*self.collective
    }

    pub(super) fn world(&self) -> usize {
        self.collective.world()
    }

    pub(super) fn rank(&self) -> usize {
        self.collective.rank()
    }

    /// Every rank's outcome of a part each did: this rank's error, or one
    /// naming the rank that failed (the outer error: the collective
    /// itself failed).
    pub(super) fn agree(&self, outcome: Result<()>) -> Result<Result<()>> {
        let (world, rank) = (self.world(), self.rank());
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
    pub(super) fn any_rank(&self, flag: bool) -> Result<bool> {
        let mut any = [f64::from(u8::from(flag))];
        self.collective.all_reduce_scalars(&mut any)?;
        Ok(any[0] > 0.0)
    }

    /// Tokens one step takes from this rank: `grad_accumulation x
    /// micro_batch` sequences of `seq + 1` tokens (inputs and the
    /// next-token targets).
    pub(super) fn tokens_per_step(&self) -> usize {
        let train = &self.config.train;
        train.grad_accumulation * train.micro_batch * (self.model.seq() + 1)
    }
}

/// The NCCL group of `host`'s ranks on `context`'s GPU, its exchanges
/// sized as `host`'s; rank 0 says which NCCL it runs.
fn nccl_over(
    compute: &Compute,
    context: &Arc<strata_device::cuda::Context>,
    host: Box<dyn Collective>,
) -> Result<Box<dyn Collective>> {
    let (world, rank) = (host.world(), host.rank());
    let elems_max =
        super::tensors::collective_elems_max(&*compute.model, world, compute.config.shards());
    let timeout = std::time::Duration::from_secs_f64(compute.config.comm.timeout_s);
    let nccl = strata_comm::Nccl::connect(host, context.clone(), elems_max, timeout)?;
    if rank == 0 {
        let (major, minor, patch) = strata_comm::nccl_version()?;
        tracing::info!("collectives between the {world} GPUs over NCCL {major}.{minor}.{patch}");
    }
    Ok(Box::new(nccl))
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
pub(super) fn open_runtime(
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
