//! The planner: from a step's trace, tier capacities and link speeds, when
//! to issue each transfer and what to evict to where.
//!
//! Decisions are made at op boundaries: the actions of boundary `k` are
//! issued when op `k - 1` starts, so they overlap its compute. Prefetch is
//! one lookahead queue over the coming ops' tensors, in use order, across
//! both hops (NVMe -> host runs ahead of host -> device, limited by host
//! room, not by device room). A prefetch may evict only what is needed
//! after the tensor it fetches (Belady's condition), so it never displaces
//! anything needed sooner; demand fetches evict the tensor needed last.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use serde::Serialize;

use crate::error::SchedulerError;
use crate::trace::{Mode, TensorClass, Tier, Trace};

/// One link's speed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Link {
    /// Sustained bandwidth.
    pub bytes_per_s: f64,
    /// Fixed cost per transfer.
    pub latency_ns: u64,
}

impl Link {
    /// Time to move `bytes`, latency included.
    pub fn time_ns(&self, bytes: u64) -> f64 {
        self.latency_ns as f64 + bytes as f64 / self.bytes_per_s * 1e9
    }
}

/// The links between tiers, as one GPU sees them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Links {
    /// Host -> device (PCIe).
    pub host_to_device: Link,
    /// Device -> host (PCIe).
    pub device_to_host: Link,
    /// NVMe -> host.
    pub nvme_read: Link,
    /// Host -> NVMe.
    pub nvme_write: Link,
    /// Whether reads and writes proceed at once on the drives; `false`
    /// (the default assumption) makes them share the drives' time.
    pub nvme_duplex: bool,
}

/// Tensor classes, the length of per-class tables.
const CLASSES: usize = TensorClass::ALL.len();

/// A transfer lane: one FIFO queue of transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Lane {
    /// Host -> device.
    HostToDevice,
    /// Device -> host.
    DeviceToHost,
    /// NVMe -> host.
    NvmeRead,
    /// Host -> NVMe.
    NvmeWrite,
}

impl Lane {
    /// All lanes.
    pub const ALL: [Lane; 4] = [
        Lane::HostToDevice,
        Lane::DeviceToHost,
        Lane::NvmeRead,
        Lane::NvmeWrite,
    ];

    /// Its position in per-lane tables (`ALL[l.index()] == l`).
    pub fn index(self) -> usize {
        match self {
            Lane::HostToDevice => 0,
            Lane::DeviceToHost => 1,
            Lane::NvmeRead => 2,
            Lane::NvmeWrite => 3,
        }
    }

    /// The lane between two neighbouring tiers.
    pub fn between(from: Tier, to: Tier) -> Lane {
        match (from, to) {
            (Tier::Host, Tier::Device) => Lane::HostToDevice,
            (Tier::Device, Tier::Host) => Lane::DeviceToHost,
            (Tier::Nvme, Tier::Host) => Lane::NvmeRead,
            (Tier::Host, Tier::Nvme) => Lane::NvmeWrite,
            _ => panic!("no lane between {from} and {to}: transfers go hop by hop"),
        }
    }

    /// Its link.
    pub fn link(self, links: &Links) -> Link {
        match self {
            Lane::HostToDevice => links.host_to_device,
            Lane::DeviceToHost => links.device_to_host,
            Lane::NvmeRead => links.nvme_read,
            Lane::NvmeWrite => links.nvme_write,
        }
    }

    /// The queue it shares: NVMe reads and writes share one queue unless
    /// the drives are duplex.
    pub fn queue(self, links: &Links) -> usize {
        match self {
            Lane::NvmeWrite if !links.nvme_duplex => Lane::NvmeRead.index(),
            lane => lane.index(),
        }
    }
}

/// What a plan does to one tensor at one boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ActionKind {
    /// Copy to a neighbouring tier, keeping the source.
    Fetch {
        /// Source tier (holds a valid copy).
        from: Tier,
        /// Target tier.
        to: Tier,
    },
    /// Copy down a tier, then release the source.
    Evict {
        /// Source tier.
        from: Tier,
        /// Target tier, one below.
        to: Tier,
    },
    /// Release a copy that is not the last one (or of a dead tensor).
    Drop {
        /// The tier whose copy goes.
        tier: Tier,
    },
    /// Reserve room for a tensor an op is about to write whole.
    Alloc {
        /// Where.
        tier: Tier,
    },
}

/// One action, issued at the boundary before op `at_op`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Action {
    /// The boundary: issued when op `at_op - 1` starts (0: at step start;
    /// `ops.len()`: after the last op, restoring the start placement).
    pub at_op: u32,
    /// The tensor.
    pub tensor: u32,
    /// What happens.
    #[serde(flatten)]
    pub kind: ActionKind,
    /// The op that needs this transfer, when it is a fetch for it.
    pub for_op: u32,
    /// Starts only after every transfer issued before it has finished
    /// (synchronous swapping, as DeepSpeed does without pipelining).
    pub barrier: bool,
}

/// How victims are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Eviction {
    /// The copy needed furthest in the future (clean copies first on ties).
    Belady,
    /// The least recently used copy.
    Lru,
}

/// What a policy does with one class of tensor.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ClassRule {
    /// How many ops ahead its fetches may be issued; 0 fetches on demand.
    pub prefetch_ops_max: u32,
    /// Release (or write back) its copy on the op's tier right after use
    /// when the next op does not use it.
    pub evict_after_use: bool,
    /// Write-backs of this class are synchronous (barriers).
    pub synchronous_writeback: bool,
    /// Keep the host copy of a tensor whose home is NVMe once it is on the
    /// device (strata: a cache, evicted by need); `false` frees that
    /// staging buffer after the use, as DeepSpeed's parameter swapper does.
    pub keep_host_copy: bool,
}

/// A planning policy: strata's, or the DeepSpeed-like baseline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Policy {
    /// A name for reports.
    pub name: &'static str,
    /// Victim choice.
    pub eviction: Eviction,
    /// Rules per [`TensorClass`] (indexed by `TensorClass::index`).
    pub rules: [ClassRule; CLASSES],
    /// Stop the lookahead at the first tensor whose only copy is on NVMe.
    pub stop_at_nvme: bool,
    /// Bytes fetched ahead of the current op, at most: sized at start.
    /// strata's callers give what the device and host tiers hold for the
    /// plan (everything fetched ahead sits there), so the op-count
    /// lookahead is what binds in practice.
    pub prefetch_bytes_max: u64,
    /// Transfers queued or running per lane, at most (prefetches; demand
    /// fetches are never held back).
    pub transfers_in_flight_max: u32,
    /// Start the moves a copy has to make anyway as soon as its use on a
    /// tier is done, so that they overlap compute instead of holding room
    /// (or the next step) up: write the only copy down when its next use
    /// is on a lower tier (a gradient for the CPU optimizer), and send a
    /// tensor home when the step is done with it (parameters the CPU
    /// optimizer updated, while backward goes on).
    pub move_early: bool,
}

impl Policy {
    /// strata: Belady eviction, one lookahead queue over every class and
    /// both hops, bounded by `lookahead_ops_max` ops, `prefetch_bytes_max`
    /// bytes ahead (the caller's device and host room for the plan) and
    /// `transfers_in_flight_max` per lane; activations prefetched at most
    /// `activation_horizon_ops` ahead.
    pub fn strata(
        lookahead_ops_max: u32,
        activation_horizon_ops: u32,
        prefetch_bytes_max: u64,
    ) -> Policy {
        let rule = ClassRule {
            prefetch_ops_max: lookahead_ops_max,
            evict_after_use: false,
            synchronous_writeback: false,
            keep_host_copy: true,
        };
        let mut rules = [rule; CLASSES];
        rules[TensorClass::Activation.index()].prefetch_ops_max =
            activation_horizon_ops.min(lookahead_ops_max);
        Policy {
            name: "strata",
            eviction: Eviction::Belady,
            rules,
            stop_at_nvme: false,
            prefetch_bytes_max,
            transfers_in_flight_max: 16,
            move_early: true,
        }
    }

    /// What strata does in a step it has no trace for (step 1, while it is
    /// recorded, or after a step departs from its plan): it cannot know
    /// next uses, so it fetches on demand, releases parameter copies and
    /// writes gradients and optimizer states down right after their use,
    /// and evicts the least recently used copy when it needs room.
    pub fn recording() -> Policy {
        let rule = ClassRule {
            prefetch_ops_max: 0,
            evict_after_use: false,
            synchronous_writeback: false,
            keep_host_copy: true,
        };
        let mut rules = [rule; CLASSES];
        for class in [
            TensorClass::Param,
            TensorClass::Grad,
            TensorClass::OptimizerState,
        ] {
            rules[class.index()].evict_after_use = true;
        }
        Policy {
            name: "strata-recording",
            eviction: Eviction::Lru,
            rules,
            stop_at_nvme: false,
            prefetch_bytes_max: 0,
            transfers_in_flight_max: 16,
            move_early: false,
        }
    }

    /// The DeepSpeed ZeRO-3 / ZeRO-Infinity behaviour at step `step` (from
    /// 1): no prefetch before step 3 (the module trace is recorded in step
    /// 2); then parameters only, a 5e7-element (1e8-byte) bucket ahead, at
    /// most 2 fetches in flight, stopping at the first parameter on NVMe;
    /// parameters released after use; least recently used eviction;
    /// optimizer states swapped per group, synchronously unless
    /// `pipelined` (`pipeline_read`/`pipeline_write`, one group ahead);
    /// offloaded activations fetched when backward asks for them.
    pub fn deepspeed(step: u32, pipelined: bool) -> Policy {
        let demand = ClassRule {
            prefetch_ops_max: 0,
            evict_after_use: false,
            synchronous_writeback: false,
            keep_host_copy: true,
        };
        let mut rules = [demand; CLASSES];
        rules[TensorClass::Param.index()] = ClassRule {
            prefetch_ops_max: if step >= 3 { 64 } else { 0 },
            evict_after_use: true,
            synchronous_writeback: false,
            keep_host_copy: false,
        };
        rules[TensorClass::Grad.index()].evict_after_use = true;
        rules[TensorClass::OptimizerState.index()] = ClassRule {
            prefetch_ops_max: u32::from(pipelined),
            evict_after_use: true,
            synchronous_writeback: !pipelined,
            keep_host_copy: false,
        };
        Policy {
            name: "deepspeed",
            eviction: Eviction::Lru,
            rules,
            stop_at_nvme: true,
            prefetch_bytes_max: 100_000_000,
            transfers_in_flight_max: 2,
            move_early: false,
        }
    }

    fn rule(&self, class: TensorClass) -> ClassRule {
        self.rules[class.index()]
    }

    fn lookahead_ops_max(&self) -> u32 {
        self.rules
            .iter()
            .map(|r| r.prefetch_ops_max)
            .max()
            .unwrap_or(0)
    }
}

/// Everything the planner needs besides the trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanConfig {
    /// Bytes each tier may hold, indexed by [`Tier::index`].
    pub capacity_bytes: [u64; 3],
    /// Link speeds.
    pub links: Links,
    /// The policy.
    pub policy: Policy,
}

/// A plan for one step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The trace's signature this plan is for.
    pub signature: u64,
    /// Actions ordered by boundary.
    pub actions: Vec<Action>,
    /// `actions[boundary_start[k]..boundary_start[k + 1]]` is boundary `k`.
    pub boundary_start: Vec<u32>,
    /// The most bytes the plan keeps on each tier at once.
    pub peak_bytes: [u64; 3],
    /// The most bytes of NVMe transfers in flight at once, by the
    /// planner's estimate: the pinned staging it needs.
    pub staging_bytes_max: u64,
    /// The most bytes of each class on each tier at once
    /// (`[class.index()][tier.index()]`).
    pub peak_class_bytes: [[u64; 3]; CLASSES],
    /// Transfers the plan issues, per [`Lane`].
    pub transfers: [u32; 4],
    /// Bytes it moves, per [`Lane`].
    pub transfer_bytes: [u64; 4],
}

impl Plan {
    /// The actions of boundary `k`.
    pub fn actions_at(&self, k: usize) -> &[Action] {
        let range = self.boundary_start[k] as usize..self.boundary_start[k + 1] as usize;
        &self.actions[range]
    }
}

/// Plans one step. Fails with [`SchedulerError::DoesNotFit`] when some op
/// cannot have its tensors on its tier at once,
/// [`SchedulerError::StagingDoesNotFit`] when a tier a copy passes through
/// on its way has no room for it, or
/// [`SchedulerError::InitialPlacement`] when the start placement is over a
/// budget.
pub fn plan(trace: &Trace, config: &PlanConfig) -> Result<Plan, SchedulerError> {
    trace.validate()?;
    let mut planner = Planner::new(trace, config)?;
    for k in 0..trace.ops.len() {
        planner.boundary(k)?;
    }
    planner.close()?;
    let plan = planner.finish();
    debug_assert_eq!(verify(trace, &plan, &config.capacity_bytes), Ok(()));
    Ok(plan)
}

const NO_OP: u32 = u32::MAX;

/// How a victim ranks: lower goes first.
type VictimKey = (EvictionCost, Reverse<u64>, bool);

/// What evicting a copy costs, cheapest first.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum EvictionCost {
    /// Nothing: another copy exists or the next use overwrites it, and it
    /// is not needed on this tier again before that.
    Free,
    /// A write to the tier below that has to happen anyway: the next use
    /// is on a lower tier (a gradient for the CPU optimizer), or its home
    /// is.
    WriteAnyway,
    /// A fetch back later (and a write now when it is the only copy).
    Refetch,
}

struct Planner<'a> {
    trace: &'a Trace,
    config: &'a PlanConfig,
    uses: Vec<Vec<u32>>,
    writes: Vec<Vec<u32>>,
    copies: Vec<u8>,
    used: [u64; 3],
    resident: [Vec<u32>; 3],
    slot: Vec<[u32; 3]>,
    last_touch: Vec<u32>,
    ready_ns: Vec<f64>,
    actions: Vec<Action>,
    boundary_start: Vec<u32>,
    peak: [u64; 3],
    class_used: [[u64; 3]; CLASSES],
    peak_class: [[u64; 3]; CLASSES],
    // Estimated timeline: when each lane frees up, what is queued on it.
    now_ns: f64,
    processor_free_ns: [f64; 2],
    lane_free_ns: [f64; 4],
    lane_done_ns: [VecDeque<(f64, u64)>; 4],
    staging_bytes_max: u64,
    ahead: Vec<(u32, u64)>,
    transfers: [u32; 4],
    transfer_bytes: [u64; 4],
}

impl<'a> Planner<'a> {
    fn new(trace: &'a Trace, config: &'a PlanConfig) -> Result<Self, SchedulerError> {
        let count = trace.tensors.len();
        let mut planner = Planner {
            trace,
            config,
            uses: trace.uses(),
            writes: writes(trace),
            copies: vec![0; count],
            used: [0; 3],
            resident: Default::default(),
            slot: vec![[NO_OP; 3]; count],
            last_touch: vec![0; count],
            ready_ns: vec![0.0; count],
            actions: Vec::with_capacity(trace.ops.len() * 4),
            boundary_start: Vec::with_capacity(trace.ops.len() + 2),
            peak: [0; 3],
            class_used: [[0; 3]; CLASSES],
            peak_class: [[0; 3]; CLASSES],
            now_ns: 0.0,
            processor_free_ns: [0.0; 2],
            lane_free_ns: [0.0; 4],
            lane_done_ns: Default::default(),
            staging_bytes_max: 0,
            ahead: Vec::new(),
            transfers: [0; 4],
            transfer_bytes: [0; 4],
        };
        for (tensor, spec) in trace.tensors.iter().enumerate() {
            if let Some(home) = spec.home {
                planner.add_copy(tensor as u32, home);
            }
        }
        for tier in Tier::ALL {
            let (placed_bytes, capacity_bytes) = (
                planner.used[tier.index()],
                config.capacity_bytes[tier.index()],
            );
            if placed_bytes > capacity_bytes {
                return Err(SchedulerError::InitialPlacement {
                    tier,
                    placed_bytes,
                    capacity_bytes,
                });
            }
        }
        Ok(planner)
    }

    fn bytes(&self, tensor: u32) -> u64 {
        self.trace.tensors[tensor as usize].bytes
    }

    fn has(&self, tensor: u32, tier: Tier) -> bool {
        self.copies[tensor as usize] & tier.bit() != 0
    }

    fn free_bytes(&self, tier: Tier) -> u64 {
        self.config.capacity_bytes[tier.index()] - self.used[tier.index()]
    }

    fn add_copy(&mut self, tensor: u32, tier: Tier) {
        assert!(
            !self.has(tensor, tier),
            "a second copy of tensor {tensor} on {tier}"
        );
        self.copies[tensor as usize] |= tier.bit();
        self.used[tier.index()] += self.bytes(tensor);
        let list = &mut self.resident[tier.index()];
        self.slot[tensor as usize][tier.index()] = list.len() as u32;
        list.push(tensor);
        let (i, class) = (
            tier.index(),
            self.trace.tensors[tensor as usize].class.index(),
        );
        self.peak[i] = self.peak[i].max(self.used[i]);
        self.class_used[class][i] += self.bytes(tensor);
        self.peak_class[class][i] = self.peak_class[class][i].max(self.class_used[class][i]);
    }

    fn remove_copy(&mut self, tensor: u32, tier: Tier) {
        assert!(
            self.has(tensor, tier),
            "no copy of tensor {tensor} on {tier} to remove"
        );
        self.copies[tensor as usize] &= !tier.bit();
        self.used[tier.index()] -= self.bytes(tensor);
        self.class_used[self.trace.tensors[tensor as usize].class.index()][tier.index()] -=
            self.bytes(tensor);
        let position = self.slot[tensor as usize][tier.index()] as usize;
        let list = &mut self.resident[tier.index()];
        list.swap_remove(position);
        if let Some(&moved) = list.get(position) {
            self.slot[moved as usize][tier.index()] = position as u32;
        }
        self.slot[tensor as usize][tier.index()] = NO_OP;
    }

    /// The next op at or after `k` that uses `tensor`; past the end, its
    /// first use in the next step.
    fn next_use(&self, tensor: u32, k: usize) -> u64 {
        let uses = &self.uses[tensor as usize];
        let at = uses.partition_point(|&u| (u as usize) < k);
        match uses.get(at) {
            Some(&u) => u64::from(u),
            None => {
                self.trace.ops.len() as u64 + uses.first().map_or(u64::MAX / 2, |&u| u64::from(u))
            }
        }
    }

    fn emit(&mut self, k: usize, tensor: u32, kind: ActionKind, for_op: u32) {
        let class = self.trace.tensors[tensor as usize].class;
        let mut barrier = false;
        match kind {
            ActionKind::Fetch { from, to } | ActionKind::Evict { from, to } => {
                let lane = Lane::between(from, to);
                let bytes = self.bytes(tensor);
                // Synchronous swapping: a write-back, or a read from NVMe,
                // waits for every transfer before it.
                barrier = self.config.policy.rule(class).synchronous_writeback
                    && (matches!(kind, ActionKind::Evict { .. }) || lane == Lane::NvmeRead);
                self.schedule_transfer(lane, tensor, bytes, barrier);
                if let ActionKind::Evict { .. } = kind {
                    self.remove_copy(tensor, from);
                }
                self.add_copy(tensor, to);
            }
            ActionKind::Drop { tier } => self.remove_copy(tensor, tier),
            ActionKind::Alloc { tier } => self.add_copy(tensor, tier),
        }
        self.actions.push(Action {
            at_op: k as u32,
            tensor,
            kind,
            for_op,
            barrier,
        });
    }

    fn schedule_transfer(&mut self, lane: Lane, tensor: u32, bytes: u64, barrier: bool) {
        let links = &self.config.links;
        let queue = lane.queue(links);
        let mut start = self.now_ns.max(self.lane_free_ns[queue]);
        if barrier {
            start = start.max(self.lane_free_ns.iter().copied().fold(0.0, f64::max));
        }
        let done = start + lane.link(links).time_ns(bytes);
        self.lane_free_ns[queue] = done;
        self.lane_done_ns[queue].push_back((
            done,
            if matches!(lane, Lane::NvmeRead | Lane::NvmeWrite) {
                bytes
            } else {
                0
            },
        ));
        self.ready_ns[tensor as usize] = done;
        self.transfers[lane.index()] += 1;
        self.transfer_bytes[lane.index()] += bytes;
        let staging: u64 = self.lane_done_ns[Lane::NvmeRead.index()]
            .iter()
            .chain(&self.lane_done_ns[Lane::NvmeWrite.index()])
            .map(|&(_, b)| b)
            .sum();
        self.staging_bytes_max = self.staging_bytes_max.max(staging);
    }

    fn in_flight(&self, lane: Lane) -> u32 {
        self.lane_done_ns[lane.queue(&self.config.links)].len() as u32
    }

    /// Frees `bytes` on `tier` before op `k`, evicting copies that op `k`
    /// does not use and, for a prefetch for op `bar`, only copies needed
    /// after `bar`. Emits nothing and returns false when it cannot.
    fn make_room(&mut self, tier: Tier, bytes: u64, k: usize, bar: Option<u64>) -> bool {
        if self.free_bytes(tier) >= bytes {
            return true;
        }
        if tier == Tier::Nvme {
            return false;
        }
        let trace = self.trace;
        let in_op = |t: u32| {
            trace
                .ops
                .get(k)
                .is_some_and(|op| op.accesses.iter().any(|a| a.tensor == t))
        };
        let candidates: Vec<(u64, u32)> = self.resident[tier.index()]
            .iter()
            .copied()
            .filter(|&t| !in_op(t))
            .map(|t| (self.next_use(t, k), t))
            .filter(|&(next, _)| bar.is_none_or(|b| next > b))
            .collect();
        let evictable: u64 = candidates.iter().map(|&(_, t)| self.bytes(t)).sum();
        if self.free_bytes(tier) + evictable < bytes {
            return false;
        }
        // Victims in order of their key, each computed once; a heap, as
        // usually only a few of many candidates go.
        let mut victims: BinaryHeap<Reverse<(VictimKey, u32)>> = candidates
            .into_iter()
            .map(|(next, t)| {
                let key = match self.config.policy.eviction {
                    // Belady among copies that will have to come back;
                    // before them, copies that are not needed on this tier
                    // again (free to drop, then those written down anyway).
                    Eviction::Belady => (
                        self.eviction_cost(t, tier, next),
                        Reverse(next),
                        self.copies[t as usize] == tier.bit(),
                    ),
                    Eviction::Lru => (
                        EvictionCost::Free,
                        Reverse(u64::from(u32::MAX - self.last_touch[t as usize])),
                        false,
                    ),
                };
                Reverse((key, t))
            })
            .collect();
        while self.free_bytes(tier) < bytes {
            let Some(Reverse((_, victim))) = victims.pop() else {
                break;
            };
            if !self.evict(victim, tier, k, bar) {
                return false;
            }
        }
        self.free_bytes(tier) >= bytes
    }

    /// What evicting `t`'s copy on `tier` costs, given its next use `next`.
    fn eviction_cost(&self, t: u32, tier: Tier, next: u64) -> EvictionCost {
        if self.overwritten_next(t, next) {
            return EvictionCost::Free;
        }
        let below = |other: Tier| other.index() > tier.index();
        let needed_here = match self.trace.ops.get(next as usize) {
            Some(op) => !below(op.processor.tier()),
            None => !self.trace.tensors[t as usize].home.is_some_and(below),
        };
        match (needed_here, self.copies[t as usize] != tier.bit()) {
            (true, _) => EvictionCost::Refetch,
            (false, true) => EvictionCost::Free,
            (false, false) => EvictionCost::WriteAnyway,
        }
    }

    /// Whether `t`'s copy on `tier` has to be written to a lower tier before
    /// its next use after op `done`: that use runs on a lower tier, or,
    /// past the step's end, its home is lower; and does not overwrite it.
    fn must_go_down(&self, t: u32, tier: Tier, done: usize) -> bool {
        self.copies[t as usize] == tier.bit()
            && self.eviction_cost(t, tier, self.next_use(t, done + 1)) == EvictionCost::WriteAnyway
    }

    /// Whether op `next` (the next use of `t`) overwrites it whole: its
    /// contents until then are dead.
    fn overwritten_next(&self, t: u32, next: u64) -> bool {
        overwritten_at(self.trace, t, next)
    }

    /// Removes `tensor`'s copy on `tier`: a free drop when another copy
    /// exists, else a write one tier down (making room there first).
    fn evict(&mut self, tensor: u32, tier: Tier, k: usize, bar: Option<u64>) -> bool {
        if self.copies[tensor as usize] != tier.bit()
            || self.overwritten_next(tensor, self.next_use(tensor, k))
        {
            self.emit(k, tensor, ActionKind::Drop { tier }, NO_OP);
            return true;
        }
        let Some(below) = tier.below() else {
            return false;
        };
        if !self.make_room(below, self.bytes(tensor), k, bar) {
            return false;
        }
        self.emit(
            k,
            tensor,
            ActionKind::Evict {
                from: tier,
                to: below,
            },
            NO_OP,
        );
        true
    }

    fn boundary(&mut self, k: usize) -> Result<(), SchedulerError> {
        self.boundary_start.push(self.actions.len() as u32);
        if k > 0 {
            self.after_op(k - 1, k);
        }
        self.ahead.retain(|&(op, _)| op as usize > k);
        for queue in &mut self.lane_done_ns {
            while queue.front().is_some_and(|&(done, _)| done <= self.now_ns) {
                queue.pop_front();
            }
        }
        self.demand(k)?;
        self.prefetch(k);
        // Estimated start of op k: its processor is free and its tensors
        // have arrived. Boundary k + 1 is issued then.
        let op = &self.trace.ops[k];
        let processor = op.processor as usize;
        let ready = op
            .accesses
            .iter()
            .map(|a| self.ready_ns[a.tensor as usize])
            .fold(0.0, f64::max);
        let start = self.processor_free_ns[processor].max(ready) + op.gather_ns as f64;
        self.processor_free_ns[processor] = start + op.compute_ns as f64;
        self.now_ns = self.now_ns.max(start);
        Ok(())
    }

    /// After op `done` ran: a write leaves one copy; dead transients and
    /// use-once classes go.
    fn after_op(&mut self, done: usize, k: usize) {
        let (trace, config) = (self.trace, self.config);
        let op = &trace.ops[done];
        let tier = op.processor.tier();
        for &access in &op.accesses {
            let t = access.tensor;
            self.last_touch[t as usize] = done as u32;
            if access.mode != Mode::Read {
                for other in Tier::ALL {
                    if other != tier && self.has(t, other) {
                        self.remove_copy(t, other);
                    }
                }
            }
        }
        for &access in &op.accesses {
            let t = access.tensor;
            let spec = &trace.tensors[t as usize];
            let next_used_now = trace
                .ops
                .get(k)
                .is_some_and(|o| o.accesses.iter().any(|a| a.tensor == t));
            if spec.home.is_none() && self.uses[t as usize].last() == Some(&(done as u32)) {
                for tier in Tier::ALL {
                    if self.has(t, tier) {
                        self.emit(k, t, ActionKind::Drop { tier }, NO_OP);
                    }
                }
            } else if config.policy.rule(spec.class).evict_after_use
                && !next_used_now
                && self.has(t, tier)
                && spec.home.is_none_or(|h| h.index() > tier.index())
            {
                self.evict(t, tier, k, None);
            } else if config.policy.move_early && !next_used_now {
                let home = spec.home.filter(|&h| !self.has(t, h));
                if self.must_go_down(t, tier, done) {
                    self.evict(t, tier, k, None);
                } else if let Some(home) =
                    home.filter(|_| self.uses[t as usize].last() == Some(&(done as u32)))
                {
                    // Done for the step: home now, evicting only what is
                    // needed after its first use in the next step.
                    let next = self.next_use(t, k);
                    // Best effort: a copy that cannot go home now stays.
                    let _ = self.fetch(t, home, k, NO_OP as usize, Some(next));
                }
            }
            let staging = tier == Tier::Device
                && spec.home == Some(Tier::Nvme)
                && self.has(t, Tier::Host)
                && self.has(t, Tier::Nvme);
            if staging && !config.policy.rule(spec.class).keep_host_copy && !next_used_now {
                self.emit(k, t, ActionKind::Drop { tier: Tier::Host }, NO_OP);
            }
        }
    }

    fn demand(&mut self, k: usize) -> Result<(), SchedulerError> {
        let op = &self.trace.ops[k];
        let tier = op.processor.tier();
        for &access in &op.accesses {
            let t = access.tensor;
            if self.has(t, tier) {
                continue;
            }
            let done = if access.mode == Mode::Write {
                if self.make_room(tier, self.bytes(t), k, None) {
                    self.emit(k, t, ActionKind::Alloc { tier }, k as u32);
                    Ok(())
                } else {
                    Err(tier)
                }
            } else {
                self.fetch(t, tier, k, k, None)
            };
            if let Err(short) = done {
                return Err(self.does_not_fit(k, tier, short, t));
            }
        }
        Ok(())
    }

    /// The error for op `k` (on `tier`) when room for its tensor `t` ran
    /// out on `short`: its own tier, or a tier on the way there (the
    /// host, staging a copy from NVMe), which is then the one named.
    fn does_not_fit(&self, k: usize, tier: Tier, short: Tier, t: u32) -> SchedulerError {
        if short != tier {
            let capacity_bytes = self.config.capacity_bytes[short.index()];
            return SchedulerError::StagingDoesNotFit {
                op: k,
                op_name: self.trace.ops[k].name.clone(),
                tensor: self.trace.tensors[t as usize].name.clone(),
                tier: short,
                needed_bytes: self.bytes(t),
                available_bytes: self.free_bytes(short).min(capacity_bytes),
                capacity_bytes,
            };
        }
        let op = &self.trace.ops[k];
        let mine = |t: u32| op.accesses.iter().any(|a| a.tensor == t);
        let mine_bytes: u64 = op
            .accesses
            .iter()
            .filter(|a| self.has(a.tensor, tier))
            .map(|a| self.bytes(a.tensor))
            .sum();
        let others: u64 = self.resident[tier.index()]
            .iter()
            .filter(|&&t| !mine(t))
            .map(|&t| self.bytes(t))
            .sum();
        let capacity_bytes = self.config.capacity_bytes[tier.index()];
        let needed_bytes = self.trace.op_bytes(k);
        let available_bytes = if needed_bytes > capacity_bytes {
            capacity_bytes
        } else {
            self.free_bytes(tier) + others + mine_bytes
        };
        SchedulerError::DoesNotFit {
            op: k,
            op_name: op.name.clone(),
            tier,
            needed_bytes,
            available_bytes,
            capacity_bytes,
        }
    }

    /// Brings `tensor` to `target` for op `for_op`, hop by hop, issuing at
    /// boundary `k`. `bar` limits victims (prefetch). Fails with the tier
    /// of a hop that cannot get room; hops already issued stay (they are
    /// useful).
    fn fetch(
        &mut self,
        t: u32,
        target: Tier,
        k: usize,
        for_op: usize,
        bar: Option<u64>,
    ) -> Result<(), Tier> {
        let bytes = self.bytes(t);
        while !self.has(t, target) {
            let source = nearest_copy(self.copies[t as usize], target);
            let to = source.toward(target);
            if !self.make_room(to, bytes, k, bar) {
                return Err(to);
            }
            self.emit(k, t, ActionKind::Fetch { from: source, to }, for_op as u32);
        }
        Ok(())
    }

    fn prefetch(&mut self, k: usize) {
        let (trace, policy) = (self.trace, &self.config.policy);
        let horizon = policy.lookahead_ops_max() as usize;
        let mut blocked = [false; 3];
        let mut ahead_bytes: u64 = self.ahead.iter().map(|&(_, b)| b).sum();
        let last = trace.ops.len().min(k + 1 + horizon);
        // Room that ops up to the one being fetched for will allocate for
        // their outputs: a prefetch leaves it free, so that no op waits
        // for a write-back to make room that a later op's prefetch took.
        let mut reserve_bytes = [0u64; 3];
        for j in k + 1..last {
            let op = &trace.ops[j];
            let target = op.processor.tier();
            for access in &op.accesses {
                let t = access.tensor;
                if access.mode != Mode::Write || self.has(t, target) {
                    continue;
                }
                reserve_bytes[target.index()] += self.bytes(t);
                // Make that room now, while earlier ops run, so that a
                // dirty victim's write-back overlaps them.
                let rule = policy.rule(trace.tensors[t as usize].class);
                if !blocked[target.index()]
                    && (j - k) as u32 <= rule.prefetch_ops_max
                    && !self.make_room(target, reserve_bytes[target.index()], k, Some(j as u64))
                {
                    blocked[target.index()] = true;
                }
            }
            for &access in &op.accesses {
                let t = access.tensor;
                let spec = &trace.tensors[t as usize];
                let rule = policy.rule(spec.class);
                if access.mode == Mode::Write
                    || self.copies[t as usize] == 0
                    || self.has(t, target)
                    || (j - k) as u32 > rule.prefetch_ops_max
                    || self.written_between(t, k, j)
                {
                    continue;
                }
                if self.copies[t as usize] == Tier::Nvme.bit() && policy.stop_at_nvme {
                    return;
                }
                if ahead_bytes.saturating_add(spec.bytes) > policy.prefetch_bytes_max {
                    return;
                }
                // Hop by hop, so that the NVMe hop runs ahead when the
                // device is full; each hop stops on its own limits.
                while !self.has(t, target) {
                    let from = nearest_copy(self.copies[t as usize], target);
                    let to = next_toward(from, target);
                    let lane = Lane::between(from, to);
                    if blocked[to.index()]
                        || self.in_flight(lane) >= policy.transfers_in_flight_max
                        || !self.make_room(
                            to,
                            spec.bytes + reserve_bytes[to.index()],
                            k,
                            Some(j as u64),
                        )
                    {
                        blocked[to.index()] = true;
                        break;
                    }
                    self.emit(k, t, ActionKind::Fetch { from, to }, j as u32);
                    if to == target {
                        self.ahead.push((j as u32, spec.bytes));
                        ahead_bytes += spec.bytes;
                    }
                }
                if blocked[Tier::Device.index()] && blocked[Tier::Host.index()] {
                    return;
                }
            }
        }
    }

    /// Whether an op in `k..j` writes `t`: a copy made now would be stale.
    fn written_between(&self, t: u32, k: usize, j: usize) -> bool {
        let writes = &self.writes[t as usize];
        let at = writes.partition_point(|&w| (w as usize) < k);
        writes.get(at).is_some_and(|&w| (w as usize) < j)
    }

    /// After the last op: dead transients go, and every tensor with a home
    /// is back there alone.
    fn close(&mut self) -> Result<(), SchedulerError> {
        let n = self.trace.ops.len();
        self.boundary_start.push(self.actions.len() as u32);
        if n > 0 {
            self.after_op(n - 1, n);
        }
        let count = self.trace.tensors.len() as u32;
        // Free drops first: all but the copy nearest home (copies are
        // always equal, so any one will do).
        for t in 0..count {
            let home = self.trace.tensors[t as usize].home;
            let keep = home
                .filter(|_| self.copies[t as usize] != 0)
                .map(|h| nearest_copy(self.copies[t as usize], h));
            for tier in Tier::ALL {
                if self.has(t, tier) && Some(tier) != keep {
                    self.emit(n, t, ActionKind::Drop { tier }, NO_OP);
                }
            }
        }
        // Then moves home: from the host first (freeing it), then from the
        // device through the host, then up.
        for from in [Tier::Host, Tier::Device, Tier::Nvme] {
            for t in 0..count {
                let Some(home) = self.trace.tensors[t as usize].home else {
                    continue;
                };
                if !self.has(t, from) || from == home {
                    continue;
                }
                let mut at = from;
                while at != home {
                    let to = next_toward(at, home);
                    if !self.make_room(to, self.bytes(t), n, Some(u64::MAX)) {
                        return Err(SchedulerError::DoesNotFit {
                            op: n,
                            op_name: "end of step (restoring the start placement)".into(),
                            tier: to,
                            needed_bytes: self.bytes(t),
                            available_bytes: self.free_bytes(to),
                            capacity_bytes: self.config.capacity_bytes[to.index()],
                        });
                    }
                    if to.index() > at.index() {
                        self.emit(n, t, ActionKind::Evict { from: at, to }, NO_OP);
                    } else {
                        self.emit(n, t, ActionKind::Fetch { from: at, to }, NO_OP);
                        self.emit(n, t, ActionKind::Drop { tier: at }, NO_OP);
                    }
                    at = to;
                }
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Plan {
        self.boundary_start.push(self.actions.len() as u32);
        Plan {
            signature: self.trace.signature(),
            actions: self.actions,
            boundary_start: self.boundary_start,
            peak_bytes: self.peak,
            staging_bytes_max: self.staging_bytes_max,
            peak_class_bytes: self.peak_class,
            transfers: self.transfers,
            transfer_bytes: self.transfer_bytes,
        }
    }
}

/// Whether op `k` exists and overwrites `t` whole.
fn overwritten_at(trace: &Trace, t: u32, k: u64) -> bool {
    trace.ops.get(k as usize).is_some_and(|op| {
        op.accesses
            .iter()
            .any(|a| a.tensor == t && a.mode == Mode::Write)
    })
}

/// For each tensor, the ops that write or update it, ascending.
fn writes(trace: &Trace) -> Vec<Vec<u32>> {
    let mut writes = vec![Vec::new(); trace.tensors.len()];
    for (index, op) in trace.ops.iter().enumerate() {
        for access in op.accesses.iter().filter(|a| a.mode != Mode::Read) {
            writes[access.tensor as usize].push(index as u32);
        }
    }
    writes
}

/// The tier holding a copy closest to `target` (a mask with some bit set).
fn nearest_copy(mask: u8, target: Tier) -> Tier {
    assert!(mask != 0, "a tensor with no copy cannot be fetched");
    *Tier::ALL
        .iter()
        .filter(|t| mask & t.bit() != 0)
        .min_by_key(|t| t.index().abs_diff(target.index()))
        .expect("mask has a bit")
}

/// The neighbour of `from` in the direction of `target`.
fn next_toward(from: Tier, target: Tier) -> Tier {
    from.toward(target)
}

/// Replays `plan` on `trace` in op order, independently of the planner,
/// and says what is wrong: a budget exceeded after some boundary, an op
/// whose tensor is not on its tier, a transfer from a missing copy, a last
/// copy dropped, or a tensor not back home at the end.
pub fn verify(trace: &Trace, plan: &Plan, capacity_bytes: &[u64; 3]) -> Result<(), String> {
    replay(trace, plan, capacity_bytes, &|t, _| trace.tensors[t].bytes).map(drop)
}

/// The most bytes `plan` keeps on each tier when tensor `t` takes
/// `footprint(t, tier)` bytes there (whole buffers and extents rather
/// than the one size the planner used), or what is wrong with the plan.
pub fn replay_peak_bytes(
    trace: &Trace,
    plan: &Plan,
    footprint: &dyn Fn(usize, Tier) -> u64,
) -> Result<[u64; 3], String> {
    replay(trace, plan, &[u64::MAX; 3], footprint)
}

fn replay(
    trace: &Trace,
    plan: &Plan,
    capacity_bytes: &[u64; 3],
    footprint: &dyn Fn(usize, Tier) -> u64,
) -> Result<[u64; 3], String> {
    let n = trace.ops.len();
    if plan.boundary_start.len() != n + 2 {
        return Err(format!(
            "{} boundaries for {n} ops",
            plan.boundary_start.len().saturating_sub(1)
        ));
    }
    let mut copies: Vec<u8> = trace
        .tensors
        .iter()
        .map(|t| t.home.map_or(0, Tier::bit))
        .collect();
    let mut used = [0u64; 3];
    for (t, spec) in trace.tensors.iter().enumerate() {
        if let Some(home) = spec.home {
            used[home.index()] += footprint(t, home);
        }
    }
    let mut peak = used;
    let uses = trace.uses();
    for k in 0..=n {
        for action in plan.actions_at(k) {
            let t = action.tensor as usize;
            let bytes = |tier: Tier| footprint(t, tier);
            let has = |copies: &[u8], tier: Tier| copies[t] & tier.bit() != 0;
            match action.kind {
                ActionKind::Fetch { from, to } | ActionKind::Evict { from, to } => {
                    if !has(&copies, from)
                        || has(&copies, to)
                        || from.index().abs_diff(to.index()) != 1
                    {
                        return Err(format!(
                            "boundary {k}: bad transfer of {} {from} -> {to} (copies {:#b})",
                            trace.tensors[t].name, copies[t]
                        ));
                    }
                    copies[t] |= to.bit();
                    used[to.index()] += bytes(to);
                    if let ActionKind::Evict { .. } = action.kind {
                        copies[t] &= !from.bit();
                        used[from.index()] -= bytes(from);
                    }
                }
                ActionKind::Drop { tier } => {
                    let next = uses[t].iter().find(|&&u| u as usize >= k);
                    let dead = match next {
                        Some(&u) => overwritten_at(trace, t as u32, u64::from(u)),
                        None => trace.tensors[t].home.is_none(),
                    };
                    if !has(&copies, tier) || (copies[t] == tier.bit() && !dead) {
                        return Err(format!(
                            "boundary {k}: drop of {} on {tier} loses it (copies {:#b})",
                            trace.tensors[t].name, copies[t]
                        ));
                    }
                    copies[t] &= !tier.bit();
                    used[tier.index()] -= bytes(tier);
                }
                ActionKind::Alloc { tier } => {
                    if has(&copies, tier) {
                        return Err(format!(
                            "boundary {k}: second copy of {} on {tier}",
                            trace.tensors[t].name
                        ));
                    }
                    copies[t] |= tier.bit();
                    used[tier.index()] += bytes(tier);
                }
            }
            for tier in Tier::ALL {
                peak[tier.index()] = peak[tier.index()].max(used[tier.index()]);
                if used[tier.index()] > capacity_bytes[tier.index()] {
                    return Err(format!(
                        "boundary {k}: {tier} holds {} bytes, over its {}",
                        used[tier.index()],
                        capacity_bytes[tier.index()]
                    ));
                }
            }
        }
        let Some(op) = trace.ops.get(k) else { break };
        let tier = op.processor.tier();
        for access in &op.accesses {
            let t = access.tensor as usize;
            if copies[t] & tier.bit() == 0 {
                return Err(format!(
                    "op {k} ({}) runs without {} on {tier}",
                    op.name, trace.tensors[t].name
                ));
            }
            if access.mode != Mode::Read {
                for other in Tier::ALL
                    .into_iter()
                    .filter(|&o| o != tier && copies[t] & o.bit() != 0)
                {
                    used[other.index()] -= footprint(t, other);
                }
                copies[t] = tier.bit();
            }
        }
    }
    for (t, spec) in trace.tensors.iter().enumerate() {
        let expected = spec.home.map_or(0, Tier::bit);
        if copies[t] != expected {
            return Err(format!(
                "after the step {} has copies {:#b}, expected {expected:#b}",
                spec.name, copies[t]
            ));
        }
    }
    Ok(peak)
}

#[cfg(test)]
mod tests {
    use super::Lane;

    #[test]
    fn lane_indices_round_trip() {
        for (i, lane) in Lane::ALL.into_iter().enumerate() {
            assert_eq!(lane.index(), i);
        }
    }
}
