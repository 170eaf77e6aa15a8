//! The discrete-event simulator: runs a plan against link speeds and
//! capacities, op by op, and reports step time, busy time per resource,
//! stalls and a per-tier memory timeline. Time is simulated, never read.
//!
//! It follows the runtime's rules: one FIFO queue per link direction (NVMe
//! reads and writes share one unless the drives are duplex); a transfer
//! starts when its source copy is valid, its target has room and the ops
//! before its boundary that it must wait for are done; a write leaves one
//! copy; a copy being read is released only when its readers finish.

use std::collections::VecDeque;

use serde::Serialize;

use crate::error::SchedulerError;
use crate::plan::{Action, ActionKind, Lane, Links, Plan};
use crate::trace::{Mode, Processor, Tier, Trace};

/// Hardware seen by one GPU, for [`simulate`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimConfig {
    /// Bytes each tier may hold.
    pub capacity_bytes: [u64; 3],
    /// Link speeds.
    pub links: Links,
    /// Collective ops (all-gather, reduce-scatter) queued ahead of the
    /// GPU's current op, at most.
    pub gathers_ahead_max: u32,
    /// Points kept in the memory timeline.
    pub timeline_points_max: usize,
}

/// One sample of memory per tier.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TimelinePoint {
    /// Simulated time.
    pub time_s: f64,
    /// Bytes on device, host, NVMe.
    pub bytes: [u64; 3],
}

/// What a simulated step did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimReport {
    /// Wall time of the step.
    pub step_time_s: f64,
    /// Busy time of the GPU's compute.
    pub gpu_busy_s: f64,
    /// Busy time of the CPU (optimizer).
    pub cpu_busy_s: f64,
    /// Busy time of the collective link.
    pub collective_busy_s: f64,
    /// Busy time per lane ([`Lane`] order).
    pub lane_busy_s: [f64; 4],
    /// Bytes per lane.
    pub lane_bytes: [u64; 4],
    /// Time the GPU sat idle between ops, waiting for data, collectives or
    /// the CPU.
    pub stall_s: f64,
    /// The most bytes on each tier at once.
    pub peak_bytes: [u64; 3],
    /// Memory per tier over the step, at most `timeline_points_max` points.
    pub timeline: Vec<TimelinePoint>,
}

/// Runs `plan` for `trace`. Fails with [`SchedulerError::Stuck`] when the
/// plan leaves an op without its tensors (planner plans never do).
pub fn simulate(
    trace: &Trace,
    plan: &Plan,
    config: &SimConfig,
) -> Result<SimReport, SchedulerError> {
    let mut sim = Sim::new(trace, plan, config);
    sim.run()?;
    Ok(sim.report())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum CopyState {
    Absent,
    Filling,
    Valid,
}

struct Sim<'a> {
    trace: &'a Trace,
    plan: &'a Plan,
    config: &'a SimConfig,
    now_ns: f64,
    copies: Vec<[CopyState; 3]>,
    readers: Vec<[u32; 3]>,
    release_pending: Vec<[bool; 3]>,
    used: [u64; 3],
    peak: [u64; 3],
    /// Last op before each action's boundary it must wait for.
    wait_op: Vec<Option<u32>>,
    action_done: Vec<bool>,
    oldest_incomplete: usize,
    /// Each tensor's actions in plan order and the first not done: they
    /// run one after another, and an op waits for those before it.
    tensor_actions: Vec<Vec<u32>>,
    tensor_cursor: Vec<usize>,
    boundaries_issued: usize,
    pending_local: VecDeque<usize>,
    /// Per tier, the actions that need room there, in plan order: room is
    /// granted in that order, so a later boundary never takes what the
    /// plan counted on for an earlier one.
    grants: [VecDeque<usize>; 3],
    queues: [VecDeque<usize>; 4],
    running: [Option<(usize, f64)>; 4],
    lane_busy_ns: [f64; 4],
    lane_bytes: [u64; 4],
    op_started: Vec<bool>,
    op_finished: Vec<bool>,
    dep_op: Vec<Option<u32>>,
    gathered: Vec<bool>,
    per_processor: [Vec<u32>; 2],
    cursor: [usize; 2],
    processor_running: [Option<(usize, f64)>; 2],
    processor_free_since_ns: [f64; 2],
    busy_ns: [f64; 2],
    stall_ns: f64,
    collective_queue: VecDeque<(usize, bool)>,
    collective_running: Option<(usize, bool, f64)>,
    collective_busy_ns: f64,
    timeline: Vec<TimelinePoint>,
}

impl<'a> Sim<'a> {
    fn new(trace: &'a Trace, plan: &'a Plan, config: &'a SimConfig) -> Self {
        let count = trace.tensors.len();
        let mut copies = vec![[CopyState::Absent; 3]; count];
        let mut used = [0u64; 3];
        for (t, spec) in trace.tensors.iter().enumerate() {
            if let Some(home) = spec.home {
                copies[t][home.index()] = CopyState::Valid;
                used[home.index()] += spec.bytes;
            }
        }
        let uses = trace.uses();
        let wait_op = plan
            .actions
            .iter()
            .map(|a| wait_for(trace, &uses, a))
            .collect();
        let mut per_processor: [Vec<u32>; 2] = Default::default();
        for (k, op) in trace.ops.iter().enumerate() {
            per_processor[op.processor as usize].push(k as u32);
        }
        let mut tensor_actions = vec![Vec::new(); count];
        for (index, action) in plan.actions.iter().enumerate() {
            tensor_actions[action.tensor as usize].push(index as u32);
        }
        Sim {
            trace,
            plan,
            config,
            now_ns: 0.0,
            copies,
            readers: vec![[0; 3]; count],
            release_pending: vec![[false; 3]; count],
            used,
            peak: used,
            wait_op,
            action_done: vec![false; plan.actions.len()],
            oldest_incomplete: 0,
            tensor_actions,
            tensor_cursor: vec![0; count],
            boundaries_issued: 0,
            pending_local: VecDeque::new(),
            grants: Default::default(),
            queues: Default::default(),
            running: [None; 4],
            lane_busy_ns: [0.0; 4],
            lane_bytes: [0; 4],
            op_started: vec![false; trace.ops.len()],
            op_finished: vec![false; trace.ops.len()],
            dep_op: cross_dependencies(trace),
            gathered: trace.ops.iter().map(|op| op.gather_ns == 0).collect(),
            per_processor,
            cursor: [0; 2],
            processor_running: [None; 2],
            processor_free_since_ns: [0.0; 2],
            busy_ns: [0.0; 2],
            stall_ns: 0.0,
            collective_queue: VecDeque::new(),
            collective_running: None,
            collective_busy_ns: 0.0,
            timeline: vec![TimelinePoint {
                time_s: 0.0,
                bytes: used,
            }],
        }
    }

    fn run(&mut self) -> Result<(), SchedulerError> {
        loop {
            while self.step_once() {}
            if self.op_finished.iter().all(|&d| d) && self.action_done.iter().all(|&d| d) {
                return Ok(());
            }
            let next = self
                .running
                .iter()
                .flatten()
                .map(|&(_, t)| t)
                .chain(self.processor_running.iter().flatten().map(|&(_, t)| t))
                .chain(self.collective_running.iter().map(|&(_, _, t)| t))
                .fold(f64::INFINITY, f64::min);
            if !next.is_finite() {
                return Err(self.stuck());
            }
            self.now_ns = next;
            self.complete_at(next);
        }
    }

    fn stuck(&self) -> SchedulerError {
        let op = self
            .op_finished
            .iter()
            .position(|&d| !d)
            .unwrap_or(self.trace.ops.len());
        let reason = match self.trace.ops.get(op) {
            Some(o) => {
                let tier = o.processor.tier();
                let missing: Vec<&str> = o
                    .accesses
                    .iter()
                    .filter(|a| self.copies[a.tensor as usize][tier.index()] != CopyState::Valid)
                    .map(|a| self.trace.tensors[a.tensor as usize].name.as_str())
                    .collect();
                format!("waiting for {missing:?} on {tier}, which the plan never brings")
            }
            None => "transfers after the last op cannot start".into(),
        };
        let describe = |a: usize| {
            let action = &self.plan.actions[a];
            format!(
                "{:?} of {} (boundary {})",
                action.kind, self.trace.tensors[action.tensor as usize].name, action.at_op
            )
        };
        let heads: Vec<String> = self
            .queues
            .iter()
            .filter_map(|q| q.front())
            .chain(self.pending_local.front())
            .map(|&a| describe(a))
            .collect();
        let reason = format!("{reason}; waiting to start: {}", heads.join(", "));
        SchedulerError::Stuck {
            op,
            op_name: self
                .trace
                .ops
                .get(op)
                .map_or("end of step".into(), |o| o.name.clone()),
            time_s: self.now_ns / 1e9,
            reason,
        }
    }

    fn finished(&self, op: Option<u32>) -> bool {
        op.is_none_or(|k| self.op_finished[k as usize])
    }

    /// Starts whatever can start now; true when something did.
    fn step_once(&mut self) -> bool {
        let mut progress = self.issue_boundaries();
        progress |= self.start_local();
        for queue in 0..4 {
            progress |= self.start_transfer(queue);
        }
        progress |= self.start_collective();
        for processor in [Processor::Gpu, Processor::Cpu] {
            progress |= self.start_op(processor);
        }
        progress
    }

    /// Boundary k is issued when op k - 1 has started (0 at once).
    fn issue_boundaries(&mut self) -> bool {
        let n = self.trace.ops.len();
        let mut progress = false;
        while self.boundaries_issued <= n
            && (self.boundaries_issued == 0 || self.op_started[self.boundaries_issued - 1])
        {
            let k = self.boundaries_issued;
            for index in
                self.plan.boundary_start[k] as usize..self.plan.boundary_start[k + 1] as usize
            {
                match self.plan.actions[index].kind {
                    ActionKind::Fetch { from, to } | ActionKind::Evict { from, to } => {
                        self.queues[Lane::between(from, to).queue(&self.config.links)]
                            .push_back(index);
                        self.grants[to.index()].push_back(index);
                    }
                    ActionKind::Alloc { tier } => {
                        self.pending_local.push_back(index);
                        self.grants[tier.index()].push_back(index);
                    }
                    ActionKind::Drop { .. } => self.pending_local.push_back(index),
                }
            }
            self.boundaries_issued += 1;
            progress = true;
        }
        progress
    }

    /// Whether action `a` may take `bytes` on `tier` now. Room is granted
    /// in plan order, so that a later boundary never takes what the plan
    /// counted on for an earlier one; a later action may go first when the
    /// room of every earlier one still waiting stays free.
    fn room(&self, a: usize, tier: Tier, bytes: u64) -> bool {
        let mut ahead_bytes = 0;
        for &b in &self.grants[tier.index()] {
            if b == a {
                return self.used[tier.index()] + ahead_bytes + bytes
                    <= self.config.capacity_bytes[tier.index()];
            }
            ahead_bytes += self.trace.tensors[self.plan.actions[b].tensor as usize].bytes;
        }
        unreachable!("action {a} waits for room on {tier} without a grant")
    }

    fn grant(&mut self, a: usize, tier: Tier) {
        let grants = &mut self.grants[tier.index()];
        let position = grants
            .iter()
            .position(|&b| b == a)
            .expect("a granted action was waiting");
        grants.remove(position);
    }

    fn start_local(&mut self) -> bool {
        let mut progress = false;
        let mut index = 0;
        while index < self.pending_local.len() {
            let a = self.pending_local[index];
            let action = self.plan.actions[a];
            let t = action.tensor as usize;
            let ready = self.is_next(a)
                && match action.kind {
                    // The copy may be gone already: an op on another
                    // tier that wrote the tensor meanwhile released it.
                    ActionKind::Drop { tier } => {
                        self.finished(self.wait_op[a])
                            && match self.copies[t][tier.index()] {
                                CopyState::Absent => true,
                                CopyState::Filling => false,
                                CopyState::Valid => self.readers[t][tier.index()] == 0,
                            }
                    }
                    ActionKind::Alloc { tier } => {
                        // A stale copy still being read is released when its
                        // reader finishes; the new one waits for that.
                        self.finished(self.wait_op[a])
                            && self.copies[t][tier.index()] == CopyState::Absent
                            && self.room(a, tier, self.trace.tensors[t].bytes)
                    }
                    _ => unreachable!("transfers are queued on lanes"),
                };
            if !ready {
                index += 1;
                continue;
            }
            match action.kind {
                ActionKind::Drop { tier } => self.release(t, tier),
                ActionKind::Alloc { tier } => {
                    self.grant(a, tier);
                    self.reserve(t, tier, CopyState::Valid)
                }
                _ => unreachable!(),
            }
            self.pending_local.remove(index);
            self.complete_action(a);
            progress = true;
        }
        progress
    }

    fn reserve(&mut self, t: usize, tier: Tier, state: CopyState) {
        assert!(
            self.copies[t][tier.index()] == CopyState::Absent,
            "a second copy of {} on {tier}",
            self.trace.tensors[t].name
        );
        self.copies[t][tier.index()] = state;
        self.used[tier.index()] += self.trace.tensors[t].bytes;
        assert!(
            self.used[tier.index()] <= self.config.capacity_bytes[tier.index()],
            "{tier} over budget"
        );
        self.peak[tier.index()] = self.peak[tier.index()].max(self.used[tier.index()]);
        self.sample();
    }

    /// Releases a copy now, or when its last reader finishes.
    fn release(&mut self, t: usize, tier: Tier) {
        if self.readers[t][tier.index()] > 0 {
            self.release_pending[t][tier.index()] = true;
            return;
        }
        match self.copies[t][tier.index()] {
            CopyState::Absent => return,
            CopyState::Filling => panic!(
                "{} on {tier} released while being filled",
                self.trace.tensors[t].name
            ),
            CopyState::Valid => {}
        }
        self.copies[t][tier.index()] = CopyState::Absent;
        self.used[tier.index()] -= self.trace.tensors[t].bytes;
        self.sample();
    }

    fn sample(&mut self) {
        let point = TimelinePoint {
            time_s: self.now_ns / 1e9,
            bytes: self.used,
        };
        match self.timeline.last_mut() {
            Some(last) if last.time_s == point.time_s => *last = point,
            _ => self.timeline.push(point),
        }
    }

    /// Whether `a` is its tensor's next action.
    fn is_next(&self, a: usize) -> bool {
        let t = self.plan.actions[a].tensor as usize;
        self.tensor_actions[t].get(self.tensor_cursor[t]) == Some(&(a as u32))
    }

    /// Whether the actions on `t` planned up to boundary `k` that place or
    /// remove its copy on `tier` are done (others do not concern op `k`).
    fn settled(&self, t: usize, k: usize, tier: Tier) -> bool {
        self.tensor_actions[t][self.tensor_cursor[t]..]
            .iter()
            .map(|&a| &self.plan.actions[a as usize])
            .take_while(|action| action.at_op as usize <= k)
            .all(|action| match action.kind {
                ActionKind::Fetch { to, .. } => to != tier,
                ActionKind::Evict { from, to } => from != tier && to != tier,
                ActionKind::Drop { tier: on } | ActionKind::Alloc { tier: on } => on != tier,
            })
    }

    fn complete_action(&mut self, a: usize) {
        self.action_done[a] = true;
        let t = self.plan.actions[a].tensor as usize;
        while self.tensor_actions[t]
            .get(self.tensor_cursor[t])
            .is_some_and(|&b| self.action_done[b as usize])
        {
            self.tensor_cursor[t] += 1;
        }
        while self.oldest_incomplete < self.action_done.len()
            && self.action_done[self.oldest_incomplete]
        {
            self.oldest_incomplete += 1;
        }
    }

    fn start_transfer(&mut self, queue: usize) -> bool {
        if self.running[queue].is_some() {
            return false;
        }
        let Some(&a) = self.queues[queue].front() else {
            return false;
        };
        let action = self.plan.actions[a];
        let t = action.tensor as usize;
        let (from, to) = match action.kind {
            ActionKind::Fetch { from, to } | ActionKind::Evict { from, to } => (from, to),
            _ => unreachable!("only transfers are queued on lanes"),
        };
        let bytes = self.trace.tensors[t].bytes;
        let ready = self.is_next(a)
            && self.copies[t][from.index()] == CopyState::Valid
            && self.copies[t][to.index()] == CopyState::Absent
            && self.finished(self.wait_op[a])
            && self.room(a, to, bytes)
            && (!action.barrier || self.oldest_incomplete == a);
        if !ready {
            return false;
        }
        self.queues[queue].pop_front();
        self.grant(a, to);
        self.reserve(t, to, CopyState::Filling);
        self.readers[t][from.index()] += 1;
        let lane = Lane::between(from, to);
        let duration = lane.link(&self.config.links).time_ns(bytes);
        self.lane_busy_ns[lane.index()] += duration;
        self.lane_bytes[lane.index()] += bytes;
        self.running[queue] = Some((a, self.now_ns + duration));
        true
    }

    fn start_collective(&mut self) -> bool {
        if self.collective_running.is_some() {
            return false;
        }
        // Gathers for the GPU's next ops, in order, once their tensors are
        // in place; reduces as they are queued.
        if self.collective_queue.is_empty() {
            let gpu = &self.per_processor[Processor::Gpu as usize];
            let first = self.cursor[Processor::Gpu as usize];
            for &k in gpu
                .iter()
                .skip(first)
                .take(self.config.gathers_ahead_max as usize)
            {
                let k = k as usize;
                if !self.gathered[k] {
                    if self.boundaries_issued > k && self.tensors_ready(k) {
                        self.collective_queue.push_back((k, false));
                    }
                    break;
                }
            }
        }
        let Some((k, reduce)) = self.collective_queue.pop_front() else {
            return false;
        };
        let op = &self.trace.ops[k];
        let duration = if reduce { op.reduce_ns } else { op.gather_ns } as f64;
        self.collective_busy_ns += duration;
        self.collective_running = Some((k, reduce, self.now_ns + duration));
        true
    }

    fn tensors_ready(&self, k: usize) -> bool {
        let op = &self.trace.ops[k];
        let tier = op.processor.tier();
        op.accesses.iter().all(|a| {
            self.settled(a.tensor as usize, k, tier)
                && self.copies[a.tensor as usize][tier.index()] == CopyState::Valid
        })
    }

    fn start_op(&mut self, processor: Processor) -> bool {
        let p = processor as usize;
        if self.processor_running[p].is_some() {
            return false;
        }
        let Some(&k) = self.per_processor[p].get(self.cursor[p]) else {
            return false;
        };
        let k = k as usize;
        let ready = self.boundaries_issued > k
            && (k == 0 || self.op_started[k - 1])
            && self.finished(self.dep_op[k])
            && (!self.trace.ops[k].barrier || self.op_finished[..k].iter().all(|&d| d))
            && self.gathered[k]
            && self.tensors_ready(k);
        if !ready {
            return false;
        }
        self.stall_ns += if p == Processor::Gpu as usize {
            self.now_ns - self.processor_free_since_ns[p]
        } else {
            0.0
        };
        let op = &self.trace.ops[k];
        let tier = processor.tier();
        for access in &op.accesses {
            self.readers[access.tensor as usize][tier.index()] += 1;
        }
        self.op_started[k] = true;
        self.cursor[p] += 1;
        self.busy_ns[p] += op.compute_ns as f64;
        self.processor_running[p] = Some((k, self.now_ns + op.compute_ns as f64));
        true
    }

    fn complete_at(&mut self, time: f64) {
        for queue in 0..4 {
            if let Some((a, end)) = self.running[queue]
                && end <= time
            {
                self.running[queue] = None;
                self.finish_transfer(a);
            }
        }
        for p in 0..2 {
            if let Some((k, end)) = self.processor_running[p]
                && end <= time
            {
                self.processor_running[p] = None;
                self.processor_free_since_ns[p] = time;
                self.finish_compute(k);
            }
        }
        if let Some((k, reduce, end)) = self.collective_running
            && end <= time
        {
            self.collective_running = None;
            if reduce {
                self.op_finished[k] = true;
            } else {
                self.gathered[k] = true;
            }
        }
    }

    fn finish_transfer(&mut self, a: usize) {
        let action = self.plan.actions[a];
        let t = action.tensor as usize;
        let (from, to) = match action.kind {
            ActionKind::Fetch { from, to } | ActionKind::Evict { from, to } => (from, to),
            _ => unreachable!(),
        };
        self.copies[t][to.index()] = CopyState::Valid;
        self.unread(t, from);
        if let ActionKind::Evict { .. } = action.kind {
            self.release(t, from);
        }
        self.complete_action(a);
    }

    fn unread(&mut self, t: usize, tier: Tier) {
        self.readers[t][tier.index()] -= 1;
        if self.readers[t][tier.index()] == 0 && self.release_pending[t][tier.index()] {
            self.release_pending[t][tier.index()] = false;
            self.release(t, tier);
        }
    }

    fn finish_compute(&mut self, k: usize) {
        let op = &self.trace.ops[k];
        let tier = op.processor.tier();
        for access in &op.accesses {
            let t = access.tensor as usize;
            self.unread(t, tier);
            if access.mode != Mode::Read {
                for other in Tier::ALL.into_iter().filter(|&o| o != tier) {
                    self.release(t, other);
                }
            }
        }
        if op.reduce_ns > 0 {
            self.collective_queue.push_back((k, true));
        } else {
            self.op_finished[k] = true;
        }
    }

    fn report(mut self) -> SimReport {
        self.sample();
        SimReport {
            step_time_s: self.now_ns / 1e9,
            gpu_busy_s: self.busy_ns[Processor::Gpu as usize] / 1e9,
            cpu_busy_s: self.busy_ns[Processor::Cpu as usize] / 1e9,
            collective_busy_s: self.collective_busy_ns / 1e9,
            lane_busy_s: self.lane_busy_ns.map(|ns| ns / 1e9),
            lane_bytes: self.lane_bytes,
            stall_s: self.stall_ns / 1e9,
            peak_bytes: self.peak,
            timeline: decimate(&self.timeline, self.config.timeline_points_max),
        }
    }
}

/// The last op before an action's boundary that it must wait for: for a
/// copy up or down, the last writer of the tensor (a copy made earlier
/// would go stale); for an eviction, a drop or a new copy to be written,
/// the last op that touched it.
fn wait_for(trace: &Trace, uses: &[Vec<u32>], action: &Action) -> Option<u32> {
    let t = action.tensor as usize;
    let before = &uses[t][..uses[t].partition_point(|&u| u < action.at_op)];
    let writes = |&&k: &&u32| {
        trace.ops[k as usize]
            .accesses
            .iter()
            .any(|a| a.tensor == action.tensor && a.mode != Mode::Read)
    };
    match action.kind {
        ActionKind::Fetch { .. } => before.iter().rev().find(writes).copied(),
        ActionKind::Evict { .. } | ActionKind::Drop { .. } | ActionKind::Alloc { .. } => {
            before.last().copied()
        }
    }
}

/// For each op, the latest earlier op on the other processor that shares
/// a tensor with it, one of them writing it: that op must finish first.
fn cross_dependencies(trace: &Trace) -> Vec<Option<u32>> {
    let mut last_writer: Vec<Option<u32>> = vec![None; trace.tensors.len()];
    let mut last_reader: Vec<Option<u32>> = vec![None; trace.tensors.len()];
    let mut deps = Vec::with_capacity(trace.ops.len());
    for (k, op) in trace.ops.iter().enumerate() {
        let other = |o: Option<u32>| o.filter(|&j| trace.ops[j as usize].processor != op.processor);
        let mut dep: Option<u32> = None;
        for access in &op.accesses {
            let t = access.tensor as usize;
            dep = dep.max(other(last_writer[t]));
            if access.mode != Mode::Read {
                dep = dep.max(other(last_reader[t]));
            }
        }
        deps.push(dep);
        for access in &op.accesses {
            let t = access.tensor as usize;
            if access.mode == Mode::Read {
                last_reader[t] = Some(k as u32);
            } else {
                last_writer[t] = Some(k as u32);
                last_reader[t] = Some(k as u32);
            }
        }
    }
    deps
}

/// At most `points_max` points, keeping each bucket's largest sample so
/// that peaks survive.
fn decimate(points: &[TimelinePoint], points_max: usize) -> Vec<TimelinePoint> {
    if points.len() <= points_max || points_max < 2 {
        return points.to_vec();
    }
    let per_bucket = points.len().div_ceil(points_max);
    points
        .chunks(per_bucket)
        .map(|bucket| {
            let mut point = bucket[0];
            for p in bucket {
                for tier in 0..3 {
                    point.bytes[tier] = point.bytes[tier].max(p.bytes[tier]);
                }
            }
            point
        })
        .collect()
}
