//! The trace's tensors: parameter groups and their shards, the slots
//! (two parameter sets, two state sets and the gradient per group, then
//! the saved activations), their registration and initialization, and
//! how the planner sees them (sizes, classes, tiers, links).

use half::bf16;
use strata_runtime::{Completion, Dtype, Runtime, TensorId, TensorKind, TensorMeta, Tier};
use strata_scheduler as sched;
use strata_scheduler::{Processor, TensorClass};

use crate::model::Model;

use super::PER_GROUP;
use super::config::{Placement, StateCache, StateDtype, TrainConfig};

/// Trace indices of a group's tensors: parameter set `set` (0 or 1), state
/// set `set`, and the gradient.
pub(super) fn param_index(g: usize, set: usize) -> usize {
    PER_GROUP * g + set
}

pub(super) fn state_index(g: usize, set: usize) -> usize {
    PER_GROUP * g + 2 + set
}

pub(super) fn grad_index(g: usize) -> usize {
    PER_GROUP * g + 4
}

/// Trace index of what block `b` keeps for its backward of micro-batch
/// `m`: after every group's tensors, `layers` per micro-batch.
pub(super) fn saved_index(groups: usize, layers: usize, m: usize, b: usize) -> usize {
    PER_GROUP * groups + m * layers + b
}

/// A tensor of the trace and its runtime copy.
pub(super) struct Slot {
    pub(super) meta: TensorMeta,
    pub(super) home: Option<Tier>,
    pub(super) id: Option<TensorId>,
    /// The planned move in flight, and its target tier.
    pub(super) pending: Option<(Completion, Tier)>,
    /// Written by a late update this step, and in the state cache: its host copy stays for the
    /// next step's update, its write-back waits for backward.
    pub(super) fresh: bool,
}

/// A parameter group's shard geometry and weight-decay runs.
#[derive(Clone, Debug)]
pub(super) struct Group {
    pub(super) name: String,
    pub(super) params: usize,
    pub(super) shard: usize,
    /// Runs of this rank's shard that are (or are not) weight-decayed.
    pub(super) runs: Vec<(std::ops::Range<usize>, bool)>,
    /// The index of this rank's first element among all the model's
    /// parameters (whatever the number of ranks): what stochastic
    /// rounding's random bits are keyed by.
    pub(super) first: u64,
    /// The ranges the model reads in f32 whatever the compute dtype
    /// (adjacent ones merged): what one rank widens when it gathers.
    pub(super) reads_f32: Vec<std::ops::Range<usize>>,
}

impl Group {
    pub(super) fn padded(&self, world: usize) -> usize {
        self.shard * world
    }
}

/// The tier an op's processor works in.
pub(super) fn processor_tier(processor: Processor) -> Tier {
    match processor {
        Processor::Gpu => Tier::Device,
        Processor::Cpu => Tier::Host,
    }
}

/// The state cache: how many leading groups' states fit in it, and their
/// host bytes (none unless the states live on NVMe).
pub(super) fn state_cache(
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

/// The most floats one collective call carries: a whole (padded) group.
pub(super) fn collective_elems_max(model: &dyn Model, world: usize, shards: usize) -> usize {
    let padded = |ranks: usize| {
        let shard_max = groups(model, ranks, 0).iter().map(|g| g.shard).max();
        shard_max.expect("groups") * ranks
    };
    padded(world).max(padded(shards))
}

/// The f32 words of a state tensor of `n` parameters: master weights, m
/// and v in `dtype`'s formats, padded to a whole word (bf16 states take 6
/// bytes a parameter, so an odd shard ends in half a word).
pub(super) fn state_words(dtype: StateDtype, n: usize) -> usize {
    (n * dtype.bytes_per_param()).div_ceil(4)
}

/// A state tensor's bytes into `bytes` (its old contents dropped, its
/// capacity kept): master weights, then m and v (zeros when none), in
/// `dtype`'s formats (bf16 rounded to nearest: exact for values that were
/// bf16), padded with zeros to [`state_words`].
pub(super) fn encode_states(
    dtype: StateDtype,
    master: &[f32],
    moments: Option<(&[f32], &[f32])>,
    bytes: &mut Vec<u8>,
) {
    bytes.clear();
    let encode = |bytes: &mut Vec<u8>, values: &[f32], width: usize| {
        let start = bytes.len();
        bytes.resize(start + width * values.len(), 0);
        crate::hf::narrow(values, &mut bytes[start..]);
    };
    encode(bytes, master, dtype.master_bytes());
    match moments {
        Some((m, v)) => {
            debug_assert!(m.len() == master.len() && v.len() == master.len());
            encode(bytes, m, dtype.moment_bytes());
            encode(bytes, v, dtype.moment_bytes());
        }
        None => bytes.resize(bytes.len() + 2 * master.len() * dtype.moment_bytes(), 0),
    }
    bytes.resize(4 * state_words(dtype, master.len()), 0);
}

/// Buffers [`super::moves::Moves::load_group`] fills, kept from one group to the next
/// (fresh ones cost a page fault per page: at billions of parameters that
/// was most of the start-up).
#[derive(Default)]
pub(super) struct LoadBuffers {
    pub(super) state: Vec<u8>,
    pub(super) param: Vec<bf16>,
}

/// The parameter groups (embeddings, then each block) and this rank's
/// shard of each.
pub(super) fn groups(model: &dyn Model, world: usize, rank: usize) -> Vec<Group> {
    let specs = model.groups();
    let mut groups = Vec::with_capacity(specs.len());
    let mut base = 0u64;
    for spec in specs {
        let (name, params) = (spec.name.clone(), spec.params());
        let shard = params.div_ceil(world);
        let begin = rank * shard;
        // Each tensor of the group, in layout order, and whether AdamW
        // decays it (weight matrices and embeddings); past the parameters,
        // the last shard's padding, which it does not. Tensor by tensor,
        // not element by element: billions of parameters take no time.
        let tensors: Vec<(std::ops::Range<usize>, bool)> = spec
            .tensors
            .iter()
            .map(|t| (t.range.clone(), t.decays))
            .collect();
        let mut runs: Vec<(std::ops::Range<usize>, bool)> = Vec::new();
        for (range, decays) in tensors.into_iter().chain([(params..usize::MAX, false)]) {
            let (start, end) = (range.start.max(begin), range.end.min(begin + shard));
            if start >= end {
                continue;
            }
            let local = start - begin..end - begin;
            match runs.last_mut() {
                Some((last, d)) if *d == decays => last.end = local.end,
                _ => runs.push((local, decays)),
            }
        }
        groups.push(Group {
            name,
            params,
            shard,
            runs,
            first: base + begin as u64,
            reads_f32: spec.f32_ranges(),
        });
        base += params as u64;
    }
    groups
}

/// What one block keeps for its backward per micro-batch: all its
/// activations, or its input only (when it recomputes), in bytes of the
/// activations' dtype.
#[derive(Clone, Copy, Debug)]
pub(super) struct Kept {
    pub(super) whole: u64,
    pub(super) input: u64,
    pub(super) dtype: Dtype,
}

/// The gradients' dtype as they leave the device: bf16 with bf16 compute
/// (the CPU optimizer's fused step takes them), unless the optimizer runs
/// on the device (its AdamW takes f32); f32 otherwise.
pub(super) fn grad_dtype(config: &TrainConfig, compute: Dtype) -> Dtype {
    match (compute, config.placement.optimizer) {
        (Dtype::Bf16, Placement::Cpu | Placement::Nvme) => Dtype::Bf16,
        _ => Dtype::F32,
    }
}

/// The trace's tensors: per group two parameter sets, two state sets and
/// the gradient; then what each block keeps for its backward, per
/// micro-batch: `kept` as block `b` recomputes (`recompute[b]`) or not.
pub(super) fn slots(
    config: &TrainConfig,
    groups: &[Group],
    kept: Kept,
    recompute: &[bool],
) -> Vec<Slot> {
    let params_home = config.placement.params.tier();
    let states_home = config.placement.optimizer.tier();
    // Gradients outlive their step when its update runs late, in the next
    // one: they stay where the optimizer reads them, or on NVMe.
    let grads_home = config.placement.gradients_tier();
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
            // Master weights then m and v, in `optim.state_dtype`: counted
            // in f32 words (bf16 moments make 2 words per parameter).
            let words = state_words(config.optim.state_dtype, n);
            slots.push(slot(
                format!("{}.optim{set}", group.name),
                TensorKind::OptimizerState,
                Dtype::F32,
                words,
                Some(states_home),
            ));
        }
        slots.push(slot(
            format!("{}.grad", group.name),
            TensorKind::Grad,
            grad_dtype(config, kept.dtype),
            n,
            Some(grads_home),
        ));
    }
    for m in 0..config.train.grad_accumulation {
        for (b, &recomputed) in recompute.iter().enumerate() {
            let saved = if recomputed { kept.input } else { kept.whole };
            slots.push(slot(
                format!("block{b}.saved.mb{m}"),
                TensorKind::Activation,
                kept.dtype,
                (saved / kept.dtype.bytes()) as usize,
                None,
            ));
        }
    }
    slots
}

pub(super) fn links() -> sched::Links {
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
pub(super) fn specs(runtime: &Runtime, slots: &[Slot]) -> Vec<sched::TensorSpec> {
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

pub(super) fn class_of(kind: TensorKind) -> TensorClass {
    match kind {
        TensorKind::Param => TensorClass::Param,
        TensorKind::Grad => TensorClass::Grad,
        TensorKind::OptimizerState => TensorClass::OptimizerState,
        TensorKind::Activation => TensorClass::Activation,
    }
}

pub(super) fn sched_tier(tier: Tier) -> sched::Tier {
    match tier {
        Tier::Device => sched::Tier::Device,
        Tier::Host => sched::Tier::Host,
        Tier::Nvme => sched::Tier::Nvme,
    }
}

pub(super) fn runtime_tier(tier: sched::Tier) -> Tier {
    match tier {
        sched::Tier::Device => Tier::Device,
        sched::Tier::Host => Tier::Host,
        sched::Tier::Nvme => Tier::Nvme,
    }
}

/// Link speeds the planner assumes for the CPU device (memory copies) and
/// the NVMe tier; they shape prefetch timing, not correctness.
pub(super) const COPY_BYTES_PER_S: f64 = 8e9;

pub(super) const NVME_BYTES_PER_S: f64 = 2e9;

/// What the planner assumes the compute runs at, per op.
pub(super) const FLOPS_PER_S: f64 = 2e10;

#[cfg(test)]
mod tests {
    use super::*;

    /// The weight-decay runs, tensor by tensor, are the element-by-element
    /// ones, on every rank of several world sizes, padding included.
    #[test]
    fn decay_runs_follow_the_tensors_on_every_rank() {
        for (hidden, vocab, seq) in [(8, 50, 16), (12, 7, 5), (4, 3, 1)] {
            let config = crate::ModelConfig {
                hidden,
                heads: 2,
                layers: 2,
                vocab,
                seq,
                ..crate::ModelConfig::default()
            };
            let model = crate::model::build(&config).unwrap();
            let specs = model.groups();
            for world in [1, 2, 3, 7] {
                for rank in 0..world {
                    for (g, group) in groups(&*model, world, rank).iter().enumerate() {
                        let begin = rank * group.shard;
                        let decays = |i: usize| {
                            specs[g]
                                .tensors
                                .iter()
                                .any(|t| t.decays && t.range.contains(&i))
                        };
                        let mut expected: Vec<(std::ops::Range<usize>, bool)> = Vec::new();
                        for i in 0..group.shard {
                            let d = decays(begin + i);
                            match expected.last_mut() {
                                Some((range, last)) if *last == d => range.end = i + 1,
                                _ => expected.push((i..i + 1, d)),
                            }
                        }
                        assert_eq!(
                            group.runs, expected,
                            "hidden {hidden} world {world} rank {rank} group {g}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn gradients_leave_in_bf16_only_with_bf16_compute_and_the_optimizer_off_the_device() {
        let mut config = TrainConfig::default();
        let groups = [Group {
            name: "g".into(),
            params: 10,
            shard: 10,
            first: 0,
            reads_f32: Vec::new(),
            runs: vec![(0..10, true)],
        }];
        let kept = |dtype| Kept {
            whole: 64,
            input: 16,
            dtype,
        };
        let grad = |config: &TrainConfig, dtype| {
            let slots = slots(config, &groups, kept(dtype), &[]);
            let grad = slots
                .iter()
                .find(|s| s.meta.kind == TensorKind::Grad)
                .unwrap();
            (grad.meta.dtype, grad.meta.len_bytes())
        };
        for placement in [Placement::Cpu, Placement::Nvme] {
            config.placement.optimizer = placement;
            assert_eq!(grad(&config, Dtype::Bf16), (Dtype::Bf16, 20));
            assert_eq!(grad(&config, Dtype::F32), (Dtype::F32, 40));
        }
        config.placement.optimizer = Placement::Device;
        assert_eq!(grad(&config, Dtype::Bf16), (Dtype::F32, 40));
    }
}
