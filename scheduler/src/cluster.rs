//! Whole clusters: builds one GPU's step trace for a decoder-only model under
//! a parallelism plan, plans it with strata's policy or the DeepSpeed-like
//! baseline, simulates it, and reports memory per tier, step time,
//! TFLOP/s and the bottleneck.
//!
//! GPUs are symmetric, so one GPU is simulated; what a node shares (NVMe
//! drives, host RAM, CPU cores, the network) is divided among its GPUs.

use serde::Serialize;

use crate::builder::{OpCost, StepModel, StepShape, Updates, Work, build_step};
use crate::error::SchedulerError;
use crate::model::{Hardware, Model, Parallelism, StateDtype, deepspeed_zero3_estimate};
use crate::plan::{ActionKind, Lane, Link, Links, Plan, PlanConfig, Policy, plan};
use crate::recompute::{Checkpointing, Held, RecomputeInput, choose, rooms};
use crate::sim::{SimConfig, SimReport, TimelinePoint, simulate};
use crate::trace::{Access, Mode, Processor, TensorClass, TensorSpec, Tier, Trace};

/// Device memory kept for the CUDA context and allocator slack.
pub const DEVICE_RESERVE_BYTES: u64 = 1 << 30;
/// Host memory per node kept for the OS and the framework.
pub const HOST_RESERVE_BYTES: u64 = 64 << 30;
/// Latency of one collective or one transfer.
const COLLECTIVE_LATENCY_NS: u64 = 20_000;
const PCIE_LATENCY_NS: u64 = 10_000;
const NVME_LATENCY_NS: u64 = 100_000;
/// The largest tiling factor tried for layers too big for the device.
const TILES_MAX: u32 = 64;
/// strata's lookahead: far enough that optimizer-state reads start during
/// backward; memory, not this, is what bounds it in practice.
const LOOKAHEAD_OPS_MAX: u32 = 4096;
/// Timeline points kept.
const TIMELINE_POINTS_MAX: usize = 400;

/// Which policy plans the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policies {
    /// strata: Belady, one lookahead queue over both hops, optimizer
    /// overlapped with backward when clipping allows, activations
    /// prefetched within a horizon.
    Strata,
    /// DeepSpeed-like (see [`Policy::deepspeed`]); `pipelined` is
    /// `pipeline_read`/`pipeline_write`.
    DeepSpeed {
        /// Optimizer swaps pipelined.
        pipelined: bool,
    },
}

impl Policies {
    fn name(self) -> &'static str {
        match self {
            Policies::Strata => "strata",
            Policies::DeepSpeed { .. } => "deepspeed",
        }
    }
}

/// One part of memory on one tier.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryPart {
    /// What it is.
    pub name: String,
    /// Where.
    pub tier: Tier,
    /// Bytes per GPU (per node for host and NVMe: see `per_node_bytes`).
    pub per_gpu_bytes: u64,
    /// Bytes per node.
    pub per_node_bytes: u64,
}

/// Utilisation of one resource over the step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResourceUse {
    /// Name (`gpu-compute`, `pcie-h2d`, `nvme`, ...).
    pub name: String,
    /// Seconds busy per step.
    pub busy_s: f64,
    /// busy / step time.
    pub utilisation: f64,
    /// Bytes moved per GPU per step (0 for compute).
    pub bytes: u64,
}

/// How activations are kept.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActivationPlan {
    /// Checkpointing on for some block: one saved input, recomputed in
    /// backward.
    pub checkpoint: bool,
    /// Blocks (of this pipeline stage) that recompute; the first ones.
    pub recomputed_layers: u32,
    /// Bytes saved per block per micro-batch.
    pub bytes_per_layer: u64,
    /// Blocks whose saved activations the plan moves off the device.
    pub offloaded_layers: u32,
    /// Blocks of activations fetched ahead of backward (SageMaker's
    /// `activation_loading_horizon`).
    pub horizon_layers: u32,
}

/// What `strata plan` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    /// Whether the run fits every tier.
    pub fits: bool,
    /// Why not, when it does not.
    pub reason: Option<String>,
    /// The policy.
    pub policy: &'static str,
    /// Parameters.
    pub params: u64,
    /// Peak device memory per GPU.
    pub device_bytes_per_gpu: u64,
    /// Peak pinned host memory per node.
    pub host_bytes_per_node: u64,
    /// NVMe used per node.
    pub nvme_bytes_per_node: u64,
    /// Steady-state step time (an optimizer step over all micro-batches).
    pub step_time_s: Option<f64>,
    /// The first step's time (strata: no trace yet; DeepSpeed: no
    /// prefetch before step 3).
    pub first_step_time_s: Option<f64>,
    /// Model TFLOP/s per GPU (recompute not counted).
    pub tflops_per_gpu: Option<f64>,
    /// The busiest resource.
    pub bottleneck: String,
    /// Each part of memory, per tier.
    pub memory: Vec<MemoryPart>,
    /// Busy time per resource.
    pub resources: Vec<ResourceUse>,
    /// Activations.
    pub activations: ActivationPlan,
    /// Linear layers split this many ways to fit (memory-centric tiling).
    pub tiles: u32,
    /// DeepSpeed's formula for the same run: (GPU bytes, CPU bytes per
    /// node), buffer factor 1; `None` without ZeRO-3 offload.
    pub deepspeed_formula_bytes: Option<(u64, u64)>,
    /// Memory per tier over the step: device per GPU, host and NVMe per
    /// node.
    pub timeline: Vec<TimelinePoint>,
    /// Capacities compared against: device per GPU, host and NVMe per node.
    pub capacity_bytes: [u64; 3],
}

/// Per-GPU shares of one model under one parallelism plan.
struct Shares {
    tensor: u64,
    param_shard: u64,
    grad_shard: u64,
    optimizer_shard: u64,
    layers: u32,
    tiles: u32,
}

impl Shares {
    fn new(model: &Model, parallelism: &Parallelism, tiles: u32) -> Shares {
        let data = u64::from(parallelism.shards());
        let stage = parallelism.zero_stage;
        Shares {
            tensor: u64::from(parallelism.tensor),
            param_shard: if stage >= 3 { data } else { 1 },
            grad_shard: if stage >= 2 { data } else { 1 },
            optimizer_shard: if stage >= 1 { data } else { 1 },
            layers: model.layers / parallelism.pipeline,
            tiles,
        }
    }
}

/// Device memory outside the plan: the framework reserve and the working
/// buffers of the op running now.
struct Working {
    /// 16-bit parameters and gradients of the largest layer, gathered
    /// (DeepSpeed's 4 x largest layer).
    gathered: u64,
    /// The next layer's gathered parameters.
    ahead: u64,
    /// One block's activations (the recompute working set).
    activations: u64,
}

impl Working {
    fn new(model: &Model, parallelism: &Parallelism, tiles: u32) -> Working {
        let largest =
            model.largest_layer_params() / u64::from(parallelism.tensor) / u64::from(tiles);
        let sharded = parallelism.zero_stage >= 3;
        Working {
            gathered: if sharded { 4 * largest } else { 0 },
            ahead: if sharded { 2 * largest } else { 0 },
            activations: model.block_activation_bytes() / u64::from(parallelism.tensor),
        }
    }

    /// All of it, the framework reserve included.
    fn device_bytes(&self) -> u64 {
        DEVICE_RESERVE_BYTES + self.gathered + self.ahead + self.activations
    }
}

/// Whether the data-parallel group spans nodes, so that collectives go
/// over the network rather than NVLink.
fn spans_nodes(hardware: &Hardware, parallelism: &Parallelism) -> bool {
    spans(hardware, parallelism, parallelism.data)
}

/// Whether `ranks` neighbouring data-parallel ranks (a tensor group apart)
/// span nodes.
fn spans(hardware: &Hardware, parallelism: &Parallelism, ranks: u32) -> bool {
    hardware.nodes > 1 && ranks > hardware.gpus_per_node / parallelism.tensor
}

/// Bytes of the largest saved activations of one block and micro-batch.
fn saved_activation_bytes(trace: &Trace) -> u64 {
    trace
        .tensors
        .iter()
        .filter(|t| t.class == TensorClass::Activation)
        .map(|t| t.bytes)
        .max()
        .unwrap_or(0)
}

/// The links one GPU sees.
fn links(hardware: &Hardware) -> Links {
    let share = f64::from(hardware.gpus_per_node);
    let drives = f64::from(hardware.nvme_drives.max(1));
    let pcie = Link {
        bytes_per_s: hardware.pcie_bytes_per_s,
        latency_ns: PCIE_LATENCY_NS,
    };
    Links {
        host_to_device: pcie,
        device_to_host: pcie,
        nvme_read: Link {
            bytes_per_s: hardware.nvme_read_bytes_per_s * drives / share,
            latency_ns: NVME_LATENCY_NS,
        },
        nvme_write: Link {
            bytes_per_s: hardware.nvme_write_bytes_per_s * drives / share,
            latency_ns: NVME_LATENCY_NS,
        },
        nvme_duplex: false,
    }
}

/// The data-parallel collective bandwidth per GPU (a ring's bus
/// bandwidth): NVLink within a node; across nodes, the node's network,
/// shared by the `tensor` data-parallel groups that run at once. A ring
/// that crosses nodes carries one stream per channel through each node's
/// NICs, whatever the GPUs per node, so its bus bandwidth is the node's
/// aggregate (as nccl-tests report it), not a per-GPU share.
fn collective_bytes_per_s(hardware: &Hardware, parallelism: &Parallelism) -> f64 {
    if spans(hardware, parallelism, parallelism.shards()) {
        hardware
            .nvlink_bytes_per_s
            .min(hardware.network_bytes_per_s / f64::from(parallelism.tensor.max(1)))
    } else {
        hardware.nvlink_bytes_per_s
    }
}

/// The bandwidth per GPU of hybrid sharding's replica groups (ranks a
/// shard group apart): NVLink while they stay in a node; across nodes, the
/// node's network shared by every replica ring that leaves it (one per GPU
/// of a shard group's part of the node, each tensor rank its own).
fn replica_bytes_per_s(hardware: &Hardware, parallelism: &Parallelism) -> f64 {
    if !spans_nodes(hardware, parallelism) {
        return hardware.nvlink_bytes_per_s;
    }
    let group_gpus = parallelism.shards() * parallelism.tensor;
    let rings = group_gpus.min(hardware.gpus_per_node).max(1);
    hardware
        .nvlink_bytes_per_s
        .min(hardware.network_bytes_per_s / f64::from(rings))
}

/// One unit the optimizer updates (a linear layer's tile, or the
/// embedding) on this GPU, before ZeRO sharding.
struct Unit {
    name: String,
    params: u64,
    /// Forward FLOPs of its matrix products.
    forward_flops: f64,
    /// Forward FLOPs of the causal attention it runs (FlashAttention's
    /// count; the attention unit only).
    attention_flops: f64,
    param: u32,
    optimizer: u32,
    grad: u32,
}

/// One GPU's step as the step builder sees it: tensor numbers and costs.
struct ClusterStep<'a> {
    parallelism: &'a Parallelism,
    hardware: &'a Hardware,
    shares: &'a Shares,
    /// By group: the embedding, then each block's units in order.
    units: Vec<Unit>,
    /// Saved activations by micro-batch, then block.
    saved: Vec<u32>,
    /// Per block: whether its backward recomputes its forward.
    recompute: &'a [bool],
    /// Units per block.
    parts: usize,
    collective_bytes_per_s: f64,
    replica_bytes_per_s: f64,
}

/// A ring collective over `ranks` of `bytes` at `bytes_per_s` a GPU
/// (`factor` 2 for an all-reduce); none for one rank.
fn ring_ns(ranks: u32, bytes: u64, factor: f64, bytes_per_s: f64) -> u64 {
    if ranks <= 1 {
        return 0;
    }
    let ranks = f64::from(ranks);
    COLLECTIVE_LATENCY_NS
        + (factor * bytes as f64 * (ranks - 1.0) / ranks / bytes_per_s * 1e9) as u64
}

impl ClusterStep<'_> {
    /// A ring collective over `bytes` (`factor` 2 for an all-reduce).
    fn ring_ns(&self, bytes: u64, factor: f64) -> u64 {
        ring_ns(
            self.parallelism.shards(),
            bytes,
            factor,
            self.collective_bytes_per_s,
        )
    }

    fn flops_ns(&self, flops: f64) -> u64 {
        gpu_ns(self.hardware, flops) as u64
    }

    /// A unit's forward, or its backward (twice its products, 2.5x its
    /// attention).
    fn unit_ns(&self, u: &Unit, backward: bool) -> f64 {
        compute_ns(self.hardware, u.forward_flops, u.attention_flops, backward)
    }

    fn optimizer_on_gpu(&self) -> bool {
        self.parallelism.offload_optimizer == Tier::Device
    }

    /// An update of `params` parameters: memory-bound, so in proportion to
    /// the bytes it moves per parameter (the CPU rate is fp32 states').
    fn optimizer_ns(&self, params: u64) -> u64 {
        let hardware = self.hardware;
        let states = self.parallelism.state_dtype;
        let traffic =
            states.step_bytes_per_param() as f64 / StateDtype::Fp32.step_bytes_per_param() as f64;
        if self.optimizer_on_gpu() {
            (36.0 * traffic * params as f64 / hardware.gpu_memory_bytes_per_s * 1e9) as u64
        } else {
            (traffic * params as f64 * f64::from(hardware.gpus_per_node)
                / hardware.cpu_optimizer_params_per_s
                * 1e9) as u64
        }
    }

    fn gather_ns(&self, unit: &Unit) -> u64 {
        if self.shares.param_shard > 1 {
            self.ring_ns(2 * unit.params, 1.0)
        } else {
            0
        }
    }

    /// Reduce-scattered in the shard group (all-reduced without gradient
    /// sharding), then, with hybrid sharding, the shard all-reduced across
    /// the replicas.
    fn reduce_ns(&self, unit: &Unit) -> u64 {
        let factor = if self.shares.grad_shard > 1 { 1.0 } else { 2.0 };
        let replicas = ring_ns(
            self.parallelism.replicas(),
            2 * unit.params / self.shares.grad_shard,
            2.0,
            self.replica_bytes_per_s,
        );
        self.ring_ns(2 * unit.params, factor) + replicas
    }

    /// The forward of block `layer`, recomputed in its backward when it
    /// keeps only its input.
    fn recompute_ns(&self, layer: usize) -> f64 {
        if !self.recompute[layer] {
            return 0.0;
        }
        let first = 1 + layer * self.parts;
        self.units[first..first + self.parts]
            .iter()
            .map(|u| self.unit_ns(u, false))
            .sum()
    }
}

impl StepModel for ClusterStep<'_> {
    fn param(&self, group: usize) -> u32 {
        self.units[group].param
    }

    fn grad(&self, group: usize) -> u32 {
        self.units[group].grad
    }

    fn saved(&self, m: usize, layer: usize) -> u32 {
        self.saved[m * self.shares.layers as usize + layer]
    }

    fn update(&self, group: usize, _late: bool) -> Vec<Access> {
        let u = &self.units[group];
        let access = |tensor, mode| Access { tensor, mode };
        vec![
            access(u.optimizer, Mode::Update),
            access(u.grad, Mode::Read),
            access(u.param, Mode::Write),
        ]
    }

    fn name(&self, group: usize) -> String {
        self.units[group].name.clone()
    }

    fn cost(&self, work: Work) -> OpCost {
        let gpu = Processor::Gpu;
        let embedding = &self.units[0];
        let unit = |layer: usize, part: usize| &self.units[1 + layer * self.parts + part];
        match work {
            Work::EmbedForward { .. } => OpCost {
                gather_ns: self.gather_ns(embedding),
                ..OpCost::compute(gpu, 1_000)
            },
            Work::Forward { layer, part, .. } => {
                let u = unit(layer, part);
                OpCost {
                    gather_ns: self.gather_ns(u),
                    ..OpCost::compute(gpu, self.unit_ns(u, false) as u64)
                }
            }
            Work::Loss { .. } => OpCost {
                gather_ns: self.gather_ns(embedding),
                ..OpCost::compute(gpu, self.flops_ns(embedding.forward_flops))
            },
            Work::Head { .. } => OpCost {
                gather_ns: self.gather_ns(embedding),
                ..OpCost::compute(gpu, self.flops_ns(3.0 * embedding.forward_flops))
            },
            Work::Backward { layer, part, .. } => {
                let u = unit(layer, part);
                let mut ns = self.unit_ns(u, true);
                if part + 1 == self.parts {
                    ns += self.recompute_ns(layer);
                }
                OpCost {
                    processor: gpu,
                    compute_ns: ns as u64,
                    gather_ns: self.gather_ns(u),
                    reduce_ns: self.reduce_ns(u),
                }
            }
            Work::EmbedBackward { .. } => OpCost {
                reduce_ns: self.reduce_ns(embedding),
                ..OpCost::compute(gpu, 1_000)
            },
            Work::Update { group, .. } => {
                let processor = if self.optimizer_on_gpu() {
                    Processor::Gpu
                } else {
                    Processor::Cpu
                };
                let params = self.units[group].params / self.shares.optimizer_shard;
                OpCost::compute(processor, self.optimizer_ns(params))
            }
            Work::Norm => OpCost::compute(gpu, 10_000),
            Work::Commit => unreachable!("the cluster model has no commit"),
        }
    }
}

/// Adds a tensor to the trace; its index.
fn add_tensor(
    trace: &mut Trace,
    name: String,
    bytes: u64,
    class: TensorClass,
    home: Option<Tier>,
) -> u32 {
    trace.tensors.push(TensorSpec {
        name,
        bytes: bytes.max(1),
        class,
        home,
    });
    trace.tensors.len() as u32 - 1
}

/// Bytes per parameter of a unit's optimizer tensor: master weights and
/// moments in the state dtype, and the fp32 gradient the optimizer reads.
fn optimizer_bytes_per_param(parallelism: &Parallelism) -> u64 {
    parallelism.state_dtype.bytes_per_param() as u64 + 4
}

/// Adds the tensors of every unit (the embedding, then each block's linear
/// layers, tile by tile) to the trace; the units by group.
fn add_units(
    trace: &mut Trace,
    model: &Model,
    parallelism: &Parallelism,
    shares: &Shares,
) -> Vec<Unit> {
    let unit =
        |trace: &mut Trace, name: String, params: u64, (forward_flops, attention_flops)| Unit {
            param: add_tensor(
                trace,
                format!("{name}.param16"),
                2 * params / shares.param_shard,
                TensorClass::Param,
                Some(parallelism.offload_param),
            ),
            optimizer: add_tensor(
                trace,
                format!("{name}.states"),
                optimizer_bytes_per_param(parallelism) * params / shares.optimizer_shard,
                TensorClass::OptimizerState,
                Some(parallelism.offload_optimizer),
            ),
            grad: add_tensor(
                trace,
                format!("{name}.grad16"),
                2 * params / shares.grad_shard,
                TensorClass::Grad,
                None,
            ),
            name,
            params,
            forward_flops,
            attention_flops,
        };
    let tp = shares.tensor;
    let tokens = model.tokens() as f64;
    let mut units = vec![unit(
        trace,
        "embed".into(),
        // The outer group: the embeddings and an untied head's matrix; the
        // head's products (tied or not) run with it.
        (model.embedding_params() + model.head_params()) / tp,
        (
            2.0 * tokens * (model.vocab * model.hidden) as f64 / tp as f64,
            0.0,
        ),
    )];
    for l in 0..shares.layers {
        for (j, (name, params)) in model.block_params().into_iter().enumerate() {
            let flops = 2.0 * tokens * params as f64;
            let attention = match j {
                1 => model.block_attention_flops(),
                _ => 0.0,
            };
            let params = params + if j == 0 { model.block_norm_params() } else { 0 };
            for t in 0..shares.tiles {
                let tile = if shares.tiles > 1 {
                    format!(".t{t}")
                } else {
                    String::new()
                };
                units.push(unit(
                    trace,
                    format!("l{l}.{name}{tile}"),
                    params / tp / u64::from(shares.tiles),
                    (
                        flops / (tp * u64::from(shares.tiles)) as f64,
                        attention / (tp * u64::from(shares.tiles)) as f64,
                    ),
                ));
            }
        }
    }
    units
}

/// Micro-batches run block by block together: all of a step's under
/// strata's policy (the engine's schedule: each block's parameters fetched
/// once per pass), one at a time under DeepSpeed's.
fn in_flight(parallelism: &Parallelism, policy: Policies) -> usize {
    match policy {
        Policies::Strata => parallelism.grad_accumulation as usize,
        Policies::DeepSpeed { .. } => 1,
    }
}

/// Builds one GPU's trace of one optimizer step (its ops by the step
/// builder).
fn build_trace(
    model: &Model,
    parallelism: &Parallelism,
    hardware: &Hardware,
    shares: &Shares,
    policy: Policies,
    recompute: &[bool],
) -> Trace {
    let mut trace = Trace::default();
    let units = add_units(&mut trace, model, parallelism, shares);
    let tp = shares.tensor;
    let micro_batches = parallelism.grad_accumulation as usize;
    let mut saved = Vec::new();
    for m in 0..micro_batches {
        for (l, &recomputed) in recompute.iter().enumerate() {
            let saved_bytes = if recomputed {
                model.checkpoint_bytes()
            } else {
                model.block_activation_bytes() / tp
            };
            saved.push(add_tensor(
                &mut trace,
                format!("m{m}.l{l}.saved"),
                saved_bytes,
                TensorClass::Activation,
                None,
            ));
        }
    }
    let overlap_optimizer = policy == Policies::Strata && !parallelism.grad_clip;
    let parts = model.block_params().len() * shares.tiles as usize;
    let shape = StepShape {
        layers: shares.layers as usize,
        parts,
        micro_batches,
        in_flight: in_flight(parallelism, policy),
        updates: if overlap_optimizer {
            Updates::InBackward
        } else {
            Updates::AfterNorm
        },
        late: false,
        norm: parallelism.grad_clip,
        commit: false,
        workspace_grads: false,
    };
    let step = ClusterStep {
        parallelism,
        hardware,
        shares,
        units,
        saved,
        recompute,
        parts,
        collective_bytes_per_s: collective_bytes_per_s(hardware, parallelism),
        replica_bytes_per_s: replica_bytes_per_s(hardware, parallelism),
    };
    trace.ops = build_step(&shape, &step)
        .into_iter()
        .map(|s| s.op)
        .collect();
    trace
}

/// Plans and simulates one run.
///
/// With `checkpoint_activations` `Auto`, three sets of blocks are
/// simulated and the fastest that fits is reported: the ones
/// [`recompute::choose`](crate::recompute::choose) picks, the ones it
/// picks with no activation offloaded to the host, and every block. The
/// choice's model is a bound on PCIe and compute; the plan's transfers
/// (evictions, refetches, the activation horizon) and the NVMe traffic that
/// host memory kept for activations adds are what the simulation sees.
pub fn estimate(
    model: &Model,
    parallelism: &Parallelism,
    hardware: &Hardware,
    policy: Policies,
) -> Result<Estimate, SchedulerError> {
    model.validate()?;
    hardware.validate()?;
    parallelism.validate(model, hardware)?;
    let mut best = estimate_with(model, parallelism, hardware, policy, Pick::Asked)?;
    if parallelism.checkpoint_activations != Checkpointing::Auto {
        return Ok(best);
    }
    let time = |e: &Estimate| e.step_time_s.unwrap_or(f64::INFINITY);
    for pick in [Pick::OnDevice, Pick::Every] {
        let other = estimate_with(model, parallelism, hardware, policy, pick)?;
        if other.fits && (!best.fits || time(&other) < time(&best)) {
            best = other;
        }
    }
    Ok(best)
}

/// Which blocks an estimate recomputes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pick {
    /// As `checkpoint_activations` says (for `Auto`, `recompute::choose`'s).
    Asked,
    /// `recompute::choose`'s with no room on the host: only what the
    /// device holds is kept whole.
    OnDevice,
    /// Every block.
    Every,
}

/// [`estimate`] with the blocks `pick` recomputes.
fn estimate_with(
    model: &Model,
    parallelism: &Parallelism,
    hardware: &Hardware,
    policy: Policies,
    pick: Pick,
) -> Result<Estimate, SchedulerError> {
    let gpus = u64::from(hardware.gpus_per_node);
    let host_per_gpu = hardware
        .host_memory_bytes
        .saturating_sub(HOST_RESERVE_BYTES)
        / gpus;
    let nvme_per_gpu = hardware.nvme_bytes_per_node() / gpus;
    // Memory-centric tiling: split linear layers until the working
    // buffers leave most of the device to the plan.
    let mut tiles = 1;
    let mut working = Working::new(model, parallelism, tiles);
    while working.gathered + working.ahead > hardware.gpu_memory_bytes / 4 && tiles < TILES_MAX {
        tiles *= 2;
        working = Working::new(model, parallelism, tiles);
    }
    let shares = Shares::new(model, parallelism, tiles);
    let device_room = hardware
        .gpu_memory_bytes
        .saturating_sub(working.device_bytes());
    let capacity = [device_room, host_per_gpu, nvme_per_gpu];
    let links = links(hardware);
    let recompute = match pick {
        Pick::Every => vec![true; shares.layers as usize],
        Pick::Asked | Pick::OnDevice => {
            let host_room = pick == Pick::Asked;
            let mut capacity = capacity;
            if !host_room {
                capacity[Tier::Host.index()] = 0;
            }
            recompute_layers(model, parallelism, hardware, &shares, capacity, policy)
        }
    };
    let trace = build_trace(model, parallelism, hardware, &shares, policy, &recompute);
    let horizon_layers =
        activation_horizon(model, parallelism, hardware, &trace, &links, &recompute);
    let ops_per_layer = model.block_params().len() as u32 * tiles;
    let (steady, first) = match policy {
        Policies::Strata => (
            Policy::strata(
                LOOKAHEAD_OPS_MAX,
                horizon_layers * ops_per_layer,
                device_room.saturating_add(host_per_gpu),
            ),
            Policy::recording(),
        ),
        Policies::DeepSpeed { pipelined } => (
            Policy::deepspeed(3, pipelined),
            Policy::deepspeed(1, pipelined),
        ),
    };
    let sim_config = SimConfig {
        capacity_bytes: capacity,
        links,
        gathers_ahead_max: 2,
        timeline_points_max: TIMELINE_POINTS_MAX,
    };
    let run = |policy: Policy| -> Result<(Plan, SimReport), SchedulerError> {
        let config = PlanConfig {
            capacity_bytes: capacity,
            links,
            policy,
        };
        let made = plan(&trace, &config)?;
        let report = simulate(&trace, &made, &sim_config)?;
        Ok((made, report))
    };
    let mut estimate = Estimate {
        fits: false,
        reason: None,
        policy: policy.name(),
        params: model.params(),
        device_bytes_per_gpu: 0,
        host_bytes_per_node: 0,
        nvme_bytes_per_node: 0,
        step_time_s: None,
        first_step_time_s: None,
        tflops_per_gpu: None,
        bottleneck: "none (does not fit)".into(),
        memory: memory_parts(parallelism, hardware, &trace, &working, None),
        resources: Vec::new(),
        activations: ActivationPlan {
            checkpoint: recompute.contains(&true),
            recomputed_layers: recompute.iter().filter(|&&r| r).count() as u32,
            bytes_per_layer: saved_activation_bytes(&trace),
            offloaded_layers: 0,
            horizon_layers,
        },
        tiles,
        deepspeed_formula_bytes: (parallelism.zero_stage == 3
            && parallelism.offload_optimizer != Tier::Device)
            .then(|| {
                deepspeed_zero3_estimate(
                    model.params(),
                    model.largest_layer_params(),
                    hardware.gpus_per_node,
                    hardware.nodes,
                    true,
                    parallelism.offload_param != Tier::Device,
                )
            }),
        timeline: Vec::new(),
        capacity_bytes: [
            hardware.gpu_memory_bytes,
            hardware.host_memory_bytes,
            hardware.nvme_bytes_per_node(),
        ],
    };
    // Without a plan, the totals are what is placed before the step.
    let placed = |tier: Tier| -> u64 {
        estimate
            .memory
            .iter()
            .filter(|p| p.tier == tier)
            .map(|p| p.per_node_bytes)
            .sum()
    };
    estimate.device_bytes_per_gpu = placed(Tier::Device) / gpus;
    estimate.host_bytes_per_node = placed(Tier::Host);
    estimate.nvme_bytes_per_node = placed(Tier::Nvme);
    if device_room == 0 {
        estimate.reason = Some(format!(
            "one layer's working buffers and activations do not fit in {:.1} GB of device memory even tiled {tiles} ways; raise --tensor-parallel or lower --micro-batch/--seq",
            hardware.gpu_memory_bytes as f64 / 1e9
        ));
        return Ok(estimate);
    }
    if host_per_gpu == 0 {
        estimate.reason = Some(format!(
            "the host has no room for the plan: its {} is within the {} kept for the OS, the framework and the CUDA driver; give the host more than {}",
            crate::gib(hardware.host_memory_bytes),
            crate::gib(HOST_RESERVE_BYTES),
            crate::gib(HOST_RESERVE_BYTES)
        ));
        return Ok(estimate);
    }
    let (made, report) = match run(steady) {
        Ok(done) => done,
        Err(
            error @ (SchedulerError::DoesNotFit { .. }
            | SchedulerError::StagingDoesNotFit { .. }
            | SchedulerError::InitialPlacement { .. }),
        ) => {
            estimate.reason = Some(error.to_string());
            return Ok(estimate);
        }
        Err(error) => return Err(error),
    };
    let first_step = run(first).map(|(_, r)| r.step_time_s).ok();
    estimate.memory = memory_parts(parallelism, hardware, &trace, &working, Some(&made));
    // Parts peak at different times; the totals are the plan's true peaks.
    estimate.device_bytes_per_gpu = working.device_bytes() + made.peak_bytes[Tier::Device.index()];
    estimate.host_bytes_per_node = made.peak_bytes[Tier::Host.index()] * gpus;
    estimate.nvme_bytes_per_node = made.peak_bytes[Tier::Nvme.index()] * gpus;
    let bubble = f64::from(parallelism.pipeline - 1) * report.gpu_busy_s
        / f64::from(parallelism.grad_accumulation);
    let step_time_s = report.step_time_s + bubble;
    let flops = model.model_flops_per_micro_batch() * f64::from(parallelism.grad_accumulation)
        / f64::from(parallelism.tensor * parallelism.pipeline);
    estimate.fits = true;
    estimate.step_time_s = Some(step_time_s);
    estimate.first_step_time_s = first_step.map(|t| t + bubble);
    estimate.tflops_per_gpu = Some(flops / step_time_s / 1e12);
    estimate.resources = resources(&report, step_time_s, hardware, parallelism);
    estimate.bottleneck = estimate
        .resources
        .iter()
        .max_by(|a, b| a.busy_s.total_cmp(&b.busy_s))
        .map_or_else(|| "none".into(), |r| r.name.clone());
    estimate.activations.offloaded_layers = made
        .actions
        .iter()
        .filter(|a| {
            matches!(
                a.kind,
                ActionKind::Evict {
                    from: Tier::Device,
                    ..
                }
            ) && trace.tensors[a.tensor as usize].class == TensorClass::Activation
        })
        .count() as u32;
    estimate.timeline = report
        .timeline
        .iter()
        .map(|p| TimelinePoint {
            time_s: p.time_s,
            bytes: [
                p.bytes[0] + working.device_bytes(),
                p.bytes[1] * gpus,
                p.bytes[2] * gpus,
            ],
        })
        .collect();
    Ok(estimate)
}

/// Nanoseconds the GPU takes for `flops` at its sustained rate.
fn gpu_ns(hardware: &Hardware, flops: f64) -> f64 {
    flops / (hardware.gpu_flops * hardware.gpu_efficiency) * 1e9
}

/// Nanoseconds of a forward (or backward: twice the products, the
/// attention's backward) of `linear` FLOPs of matrix products and
/// `attention` FLOPs of causal attention (FlashAttention's count), at the
/// measured attention rates when the hardware has them, else as products
/// of the full (unmasked) count.
fn compute_ns(hardware: &Hardware, linear: f64, attention: f64, backward: bool) -> f64 {
    let factor = if backward { 2.0 } else { 1.0 };
    let attention_ns = match hardware.attention_flops_per_s {
        Some((_, rate)) if backward => 2.5 * attention / rate * 1e9,
        Some((rate, _)) => attention / rate * 1e9,
        None => gpu_ns(hardware, factor * 2.0 * attention),
    };
    gpu_ns(hardware, factor * linear) + attention_ns
}

/// Nanoseconds of one block's forward (or backward), tensor-parallel
/// over `tensor` GPUs.
fn block_ns(model: &Model, hardware: &Hardware, tensor: u32, backward: bool) -> f64 {
    let tensor = f64::from(tensor);
    compute_ns(
        hardware,
        model.block_linear_flops() / tensor,
        model.block_attention_flops() / tensor,
        backward,
    )
}

/// Which blocks recompute: fixed, or chosen by [`recompute::choose`] for
/// one pass of the micro-batches in flight with the device and host room
/// left beside the model states homed there and the largest parameter and
/// gradient streaming through, one block's forward at the GPU's rate and
/// the parameters' (and a CPU optimizer's gradients') PCIe traffic per
/// pass. When nothing fits, every block
/// recomputes and the plan says what does not fit.
fn recompute_layers(
    model: &Model,
    parallelism: &Parallelism,
    hardware: &Hardware,
    shares: &Shares,
    capacity: [u64; 3],
    policy: Policies,
) -> Vec<bool> {
    let layers = shares.layers as usize;
    if let Some(fixed) = parallelism.checkpoint_activations.fixed(layers) {
        return fixed;
    }
    // The model states alone: the units' tensors.
    let mut states = Trace::default();
    add_units(&mut states, model, parallelism, shares);
    let bytes_of = |class| -> u64 {
        let moved = |t: &&TensorSpec| t.class == class && t.home != Some(Tier::Device);
        states.tensors.iter().filter(moved).map(|t| t.bytes).sum()
    };
    let (params, grads) = (bytes_of(TensorClass::Param), bytes_of(TensorClass::Grad));
    let held = states.tensors.iter().map(|t| Held {
        class: t.class,
        home: t.home,
        bytes: [t.bytes; 3],
    });
    let (device_room, host_room) = rooms(held, capacity);
    let links = links(hardware);
    let forward_ns = block_ns(model, hardware, parallelism.tensor, false);
    let full = model.block_activation_bytes() / shares.tensor;
    let input = model.checkpoint_bytes();
    let in_flight = in_flight(parallelism, policy);
    let passes = f64::from(parallelism.grad_accumulation.max(1)) / in_flight as f64;
    let up_ns = links.host_to_device.time_ns(2 * params);
    let down_ns = if parallelism.offload_optimizer == Tier::Device {
        0.0
    } else {
        links.device_to_host.time_ns(grads) / passes
    };
    let input_model = RecomputeInput {
        layers,
        micro_batches: in_flight,
        full_bytes: full,
        input_bytes: input.min(full),
        host_bytes: (full, input.min(full)),
        device_room_bytes: device_room,
        host_room_bytes: host_room,
        block_forward_ns: forward_ns,
        step_compute_ns: 3.0 * forward_ns * (layers * in_flight) as f64,
        device_to_host: links.device_to_host,
        host_to_device: links.host_to_device,
        link_busy_ns: (up_ns, down_ns),
    };
    choose(&input_model).map_or_else(|_| vec![true; layers], |choice| choice.recompute)
}

/// Activation blocks to fetch ahead so that a saved input arrives before
/// backward reaches its block: its PCIe time over one block's backward
/// time (twice the forward, plus the recompute when the blocks do), plus
/// one, between 1 and 8.
fn activation_horizon(
    model: &Model,
    parallelism: &Parallelism,
    hardware: &Hardware,
    trace: &Trace,
    links: &Links,
    recompute: &[bool],
) -> u32 {
    let recompute = recompute.iter().all(|&r| r);
    let backward_ns = block_ns(model, hardware, parallelism.tensor, true)
        + if recompute {
            block_ns(model, hardware, parallelism.tensor, false)
        } else {
            0.0
        };
    let fetch_ns = links.host_to_device.time_ns(saved_activation_bytes(trace));
    ((fetch_ns / backward_ns.max(1.0)).ceil() as u32 + 1).clamp(1, 8)
}

fn resources(
    report: &SimReport,
    step_time_s: f64,
    hardware: &Hardware,
    parallelism: &Parallelism,
) -> Vec<ResourceUse> {
    // Hybrid sharding within a node and across the replicas: both.
    let collective = match (
        spans(hardware, parallelism, parallelism.shards()),
        spans_nodes(hardware, parallelism),
    ) {
        (true, _) => "network",
        (false, true) => "nvlink+network",
        (false, false) => "nvlink",
    };
    let nvme_bytes =
        report.lane_bytes[Lane::NvmeRead.index()] + report.lane_bytes[Lane::NvmeWrite.index()];
    let nvme_busy =
        report.lane_busy_s[Lane::NvmeRead.index()] + report.lane_busy_s[Lane::NvmeWrite.index()];
    let list = [
        ("gpu-compute", report.gpu_busy_s, 0),
        ("cpu-optimizer", report.cpu_busy_s, 0),
        (
            "pcie-h2d",
            report.lane_busy_s[Lane::HostToDevice.index()],
            report.lane_bytes[Lane::HostToDevice.index()],
        ),
        (
            "pcie-d2h",
            report.lane_busy_s[Lane::DeviceToHost.index()],
            report.lane_bytes[Lane::DeviceToHost.index()],
        ),
        ("nvme", nvme_busy, nvme_bytes),
        (collective, report.collective_busy_s, 0),
    ];
    list.into_iter()
        .map(|(name, busy_s, bytes)| ResourceUse {
            name: name.into(),
            busy_s,
            utilisation: busy_s / step_time_s.max(1e-12),
            bytes,
        })
        .collect()
}

/// Memory per part and tier. Model states come from the trace's homes;
/// working buffers from the model; the plan adds the peak of what it keeps
/// besides (prefetched and cached copies, saved activations, staging).
/// Parts peak at different times, so they may add up to more than the
/// tier's peak.
fn memory_parts(
    parallelism: &Parallelism,
    hardware: &Hardware,
    trace: &Trace,
    working: &Working,
    made: Option<&Plan>,
) -> Vec<MemoryPart> {
    let gpus = u64::from(hardware.gpus_per_node);
    let part = |name: &str, tier: Tier, per_gpu_bytes: u64| MemoryPart {
        name: name.into(),
        tier,
        per_gpu_bytes,
        per_node_bytes: per_gpu_bytes * gpus,
    };
    let home_on = |class: TensorClass, tier: Tier| -> u64 {
        trace
            .tensors
            .iter()
            .filter(|t| t.class == class && t.home == Some(tier))
            .map(|t| t.bytes)
            .sum()
    };
    let mut parts = vec![
        part(
            "framework reserve (CUDA context, allocator slack)",
            Tier::Device,
            DEVICE_RESERVE_BYTES,
        ),
        part(
            "16-bit parameters and gradients of the largest layer, gathered (DeepSpeed's 4 x largest layer)",
            Tier::Device,
            working.gathered,
        ),
        part(
            "next layer's gathered parameters (prefetch)",
            Tier::Device,
            working.ahead,
        ),
        part(
            "one block's activations (recompute working set)",
            Tier::Device,
            working.activations,
        ),
        part(
            "16-bit parameters (model states)",
            parallelism.offload_param,
            home_on(TensorClass::Param, parallelism.offload_param),
        ),
        part(
            "master weights, moments and fp32 gradients (model states)",
            parallelism.offload_optimizer,
            home_on(TensorClass::OptimizerState, parallelism.offload_optimizer),
        ),
    ];
    let Some(made) = made else { return parts };
    let peak = |class: TensorClass, tier: Tier| made.peak_class_bytes[class.index()][tier.index()];
    for tier in [Tier::Device, Tier::Host] {
        let moved = |class| peak(class, tier).saturating_sub(home_on(class, tier));
        parts.push(part(
            &format!("saved activations on {tier}"),
            tier,
            peak(TensorClass::Activation, tier),
        ));
        parts.push(part(
            &format!("16-bit gradient shards on {tier}"),
            tier,
            peak(TensorClass::Grad, tier),
        ));
        let copies = moved(TensorClass::Param) + moved(TensorClass::OptimizerState);
        let name = if tier == Tier::Device {
            "parameter and optimizer shards fetched to the device"
        } else {
            "pinned buffers: fetched and staged copies"
        };
        parts.push(part(name, tier, copies));
    }
    parts.push(part(
        "of which in NVMe transfers at once (staging)",
        Tier::Host,
        made.staging_bytes_max,
    ));
    parts.retain(|p| p.per_gpu_bytes > 0 || p.name.contains("model states"));
    parts
}
