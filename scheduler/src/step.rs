//! Plans across steps: record the first step's trace, plan it, follow the
//! plan from step 2, notice when a step changes and re-plan, keeping one
//! plan per trace signature.

use crate::error::SchedulerError;
use crate::plan::{Action, Plan, PlanConfig, plan};
use crate::trace::{Op, TensorSpec, Trace, TraceRecorder, op_fingerprint};

/// Plans by trace signature, at most `plans_max`, least recently used
/// dropped first.
#[derive(Debug)]
pub struct PlanCache {
    entries: Vec<(Trace, Plan, u64)>,
    plans_max: usize,
    tick: u64,
    /// Plans computed.
    pub plans_made: u64,
}

impl PlanCache {
    /// An empty cache of at most `plans_max` plans.
    pub fn new(plans_max: usize) -> Self {
        assert!(plans_max > 0, "a plan cache needs room for one plan");
        PlanCache {
            entries: Vec::with_capacity(plans_max),
            plans_max,
            tick: 0,
            plans_made: 0,
        }
    }

    /// The index of the plan for `trace`, planning it if it is new.
    pub fn get_or_plan(
        &mut self,
        trace: &Trace,
        config: &PlanConfig,
    ) -> Result<usize, SchedulerError> {
        self.tick += 1;
        let signature = trace.signature();
        if let Some(index) = self
            .entries
            .iter()
            .position(|(_, p, _)| p.signature == signature)
        {
            self.entries[index].2 = self.tick;
            return Ok(index);
        }
        let made = plan(trace, config)?;
        self.plans_made += 1;
        if self.entries.len() == self.plans_max {
            let oldest = (0..self.entries.len())
                .min_by_key(|&i| self.entries[i].2)
                .expect("cache is full");
            self.entries.swap_remove(oldest);
        }
        self.entries.push((trace.clone(), made, self.tick));
        Ok(self.entries.len() - 1)
    }

    /// A cached entry whose trace starts with these op fingerprints.
    pub fn with_prefix(&self, prefix: &[u64]) -> Option<usize> {
        self.entries.iter().position(|(trace, _, _)| {
            trace.ops.len() >= prefix.len()
                && trace
                    .ops
                    .iter()
                    .zip(prefix)
                    .all(|(op, &f)| op_fingerprint(op) == f)
        })
    }

    /// Plan `index`.
    pub fn plan(&self, index: usize) -> &Plan {
        &self.entries[index].1
    }

    /// The trace plan `index` was made for.
    pub fn trace(&self, index: usize) -> &Trace {
        &self.entries[index].0
    }

    /// Plans held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no plan is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Drives planning over a run. The runtime registers tensors, calls
/// [`StepTracker::begin_step`], then [`StepTracker::op`] as each op
/// starts (issuing the actions returned), then [`StepTracker::end_step`].
/// Step 1 runs on demand while its trace is recorded; later steps follow
/// the plan for their trace; a step that departs from its plan (another
/// sequence length, another op order) switches to a cached plan with the
/// same beginning if there is one, else finishes on demand and is planned
/// at its end.
#[derive(Debug)]
pub struct StepTracker {
    config: PlanConfig,
    recorder: TraceRecorder,
    cache: PlanCache,
    current: Option<usize>,
    following: bool,
    fingerprints: Vec<u64>,
    ops_max: usize,
}

/// What the tracker says for one op.
#[derive(Debug, PartialEq)]
pub enum Follow<'a> {
    /// Issue these actions now (the boundary after this op's start).
    Plan(&'a [Action]),
    /// No plan covers this step: fetch on use.
    Demand,
}

impl StepTracker {
    /// A tracker planning with `config`, recording up to `tensors_max`
    /// tensors and `ops_max` ops per step, keeping `plans_max` plans.
    pub fn new(config: PlanConfig, tensors_max: usize, ops_max: usize, plans_max: usize) -> Self {
        StepTracker {
            config,
            recorder: TraceRecorder::new(tensors_max, ops_max),
            cache: PlanCache::new(plans_max),
            current: None,
            following: false,
            fingerprints: Vec::with_capacity(ops_max),
            ops_max,
        }
    }

    /// Registers a tensor; its index names it in ops.
    pub fn tensor(&mut self, spec: TensorSpec) -> Result<u32, SchedulerError> {
        self.recorder.tensor(spec)
    }

    /// Starts a step: the actions to issue before its first op.
    pub fn begin_step(&mut self) -> Follow<'_> {
        self.fingerprints.clear();
        self.following = self.current.is_some();
        match self.current {
            Some(index) => Follow::Plan(self.cache.plan(index).actions_at(0)),
            None => Follow::Demand,
        }
    }

    /// Starts a step whose first op is `first`: follows the cached plan
    /// that begins with it (the current one when it does), so that a
    /// program alternating between known shapes of step prefetches from
    /// its first boundary.
    pub fn begin_step_with(&mut self, first: &Op) -> Follow<'_> {
        let fingerprint = op_fingerprint(first);
        let matches = |tracker: &StepTracker, index: usize| {
            tracker.cache.trace(index).ops.first().map(op_fingerprint) == Some(fingerprint)
        };
        if !self.current.is_some_and(|i| matches(self, i))
            && let Some(index) = self.cache.with_prefix(&[fingerprint])
        {
            self.current = Some(index);
        }
        self.begin_step()
    }

    /// Op `op` starts now. While the step follows a plan only the op's
    /// fingerprint is kept (nothing is allocated); ops are recorded from
    /// the first one that departs from every cached plan.
    pub fn op(&mut self, op: &Op) -> Result<Follow<'_>, SchedulerError> {
        let k = self.fingerprints.len();
        if k == self.ops_max {
            return Err(SchedulerError::Limit {
                what: "ops_max",
                limit: self.ops_max as u64,
            });
        }
        self.fingerprints.push(op_fingerprint(op));
        if self.following {
            let current = self.current.expect("following a plan");
            let trace = self.cache.trace(current);
            let same = trace
                .ops
                .get(k)
                .is_some_and(|o| op_fingerprint(o) == self.fingerprints[k]);
            if !same {
                // A plan made for the actions before op k of another trace
                // left memory as that trace expects, so switching is safe
                // only when the whole prefix matches.
                match self.cache.with_prefix(&self.fingerprints) {
                    Some(other) => self.current = Some(other),
                    None => {
                        self.following = false;
                        self.record_followed(k)?;
                    }
                }
            }
        }
        if !self.following {
            self.recorder.op(op.clone())?;
        }
        Ok(match (self.following, self.current) {
            (true, Some(index)) => Follow::Plan(self.cache.plan(index).actions_at(k + 1)),
            _ => Follow::Demand,
        })
    }

    /// Records the first `count` ops of the followed plan's trace, which
    /// the step's ops matched.
    fn record_followed(&mut self, count: usize) -> Result<(), SchedulerError> {
        let current = self.current.expect("a plan was followed");
        for op in &self.cache.trace(current).ops[..count] {
            self.recorder.op(op.clone())?;
        }
        Ok(())
    }

    /// Ends a step; plans its trace if no plan matched it exactly. Returns
    /// whether it planned.
    pub fn end_step(&mut self) -> Result<bool, SchedulerError> {
        if self.following {
            let current = self.current.expect("following a plan");
            if self.cache.trace(current).ops.len() == self.fingerprints.len() {
                // Every op matched the plan's trace: the same step.
                self.recorder.clear_ops();
                return Ok(false);
            }
            // It ended early: a prefix of the plan's trace.
            self.record_followed(self.fingerprints.len())?;
        }
        let trace = self.recorder.finish()?;
        let made_before = self.cache.plans_made;
        self.current = Some(self.cache.get_or_plan(&trace, &self.config)?);
        Ok(self.cache.plans_made > made_before)
    }

    /// Plans a step known before it runs (a program that can list its
    /// ops up front), so that even step 1 follows a plan; the first primed
    /// trace is the one followed until a step departs from it.
    pub fn prime(&mut self, trace: &Trace) -> Result<&Plan, SchedulerError> {
        let index = self.cache.get_or_plan(trace, &self.config)?;
        self.current.get_or_insert(index);
        Ok(self.cache.plan(index))
    }

    /// The plan the current step follows, if any.
    pub fn current_plan(&self) -> Option<&Plan> {
        match (self.following, self.current) {
            (true, Some(index)) => Some(self.cache.plan(index)),
            _ => None,
        }
    }

    /// The plans held.
    pub fn cache(&self) -> &PlanCache {
        &self.cache
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Link, Links, Policy};
    use crate::trace::{Access, Mode, Processor, TensorClass, Tier};

    fn config() -> PlanConfig {
        let link = Link {
            bytes_per_s: 1e9,
            latency_ns: 10,
        };
        let links = Links {
            host_to_device: link,
            device_to_host: link,
            nvme_read: link,
            nvme_write: link,
            nvme_duplex: false,
        };
        PlanConfig {
            capacity_bytes: [100, 1000, 10_000],
            links,
            policy: Policy::strata(8, 8, 100),
        }
    }

    fn op(name: &str, tensor: u32) -> Op {
        let read = Access {
            tensor,
            mode: Mode::Read,
        };
        Op::new(name, Processor::Gpu, vec![read], 100)
    }

    fn run_step(tracker: &mut StepTracker, ops: &[Op]) -> (bool, bool) {
        let mut followed = matches!(tracker.begin_step(), Follow::Plan(_));
        for o in ops {
            followed &= matches!(tracker.op(o).unwrap(), Follow::Plan(_));
        }
        (followed, tracker.end_step().unwrap())
    }

    #[test]
    fn primed_shapes_are_followed_from_step_one_and_chosen_by_their_first_op() {
        let mut tracker = StepTracker::new(config(), 4, 16, 4);
        let mut tensors = Vec::new();
        for name in ["a", "b"] {
            let spec = TensorSpec {
                name: name.into(),
                bytes: 60,
                class: TensorClass::Param,
                home: Some(Tier::Host),
            };
            tracker.tensor(spec.clone()).unwrap();
            tensors.push(spec);
        }
        let forward = vec![op("f0", 0), op("f1", 1)];
        let reversed = vec![op("f1", 1), op("f0", 0)];
        for ops in [&forward, &reversed] {
            let trace = Trace {
                tensors: tensors.clone(),
                ops: ops.clone(),
            };
            tracker.prime(&trace).unwrap();
        }
        for ops in [&reversed, &forward, &reversed] {
            assert!(matches!(tracker.begin_step_with(&ops[0]), Follow::Plan(_)));
            for o in ops.iter() {
                assert!(matches!(tracker.op(o).unwrap(), Follow::Plan(_)));
            }
            assert!(tracker.current_plan().is_some());
            assert!(!tracker.end_step().unwrap(), "primed: nothing new to plan");
        }
        assert_eq!(tracker.cache().plans_made, 2);
    }

    #[test]
    fn a_step_departing_midway_is_planned_whole_and_followed_after() {
        let mut tracker = StepTracker::new(config(), 4, 16, 4);
        for name in ["a", "b", "c"] {
            tracker
                .tensor(TensorSpec {
                    name: name.into(),
                    bytes: 30,
                    class: TensorClass::Param,
                    home: Some(Tier::Host),
                })
                .unwrap();
        }
        let first = [op("f0", 0), op("f1", 1), op("f2", 2)];
        let departs = [op("f0", 0), op("f2", 2), op("f1", 1)];
        let short = [op("f0", 0), op("f1", 1)];
        assert_eq!(run_step(&mut tracker, &first), (false, true));
        assert_eq!(run_step(&mut tracker, &first), (true, false));
        // Follows op 0, departs at op 1: planned with its followed prefix.
        assert_eq!(run_step(&mut tracker, &departs), (false, true));
        assert!(
            (0..tracker.cache().len()).any(|i| tracker.cache().trace(i).ops == departs),
            "the departing step is planned with the prefix it followed"
        );
        assert_eq!(run_step(&mut tracker, &departs), (true, false));
        // A step that is a prefix of a plan ends early: planned too.
        assert_eq!(run_step(&mut tracker, &first), (true, false));
        assert_eq!(run_step(&mut tracker, &short), (true, true));
        assert_eq!(tracker.cache().plans_made, 3);
    }

    #[test]
    fn step_one_on_demand_then_planned_and_a_changed_step_replans_once() {
        let mut tracker = StepTracker::new(config(), 4, 16, 4);
        for (name, bytes) in [("a", 60), ("b", 60)] {
            tracker
                .tensor(TensorSpec {
                    name: name.into(),
                    bytes,
                    class: TensorClass::Param,
                    home: Some(Tier::Host),
                })
                .unwrap();
        }
        let forward = [op("f0", 0), op("f1", 1)];
        let reversed = [op("f1", 1), op("f0", 0)];
        assert_eq!(
            run_step(&mut tracker, &forward),
            (false, true),
            "step 1: demand, then planned"
        );
        assert_eq!(
            run_step(&mut tracker, &forward),
            (true, false),
            "step 2 follows the plan"
        );
        assert_eq!(
            run_step(&mut tracker, &reversed),
            (false, true),
            "another op order departs and is planned"
        );
        assert_eq!(
            run_step(&mut tracker, &forward),
            (true, false),
            "the first order's plan is still cached"
        );
        assert_eq!(run_step(&mut tracker, &reversed), (true, false));
        assert_eq!(tracker.cache().len(), 2);
        assert_eq!(tracker.cache().plans_made, 2);
    }
}
