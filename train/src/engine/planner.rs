//! Planning at start: which blocks recompute (among the candidates
//! [`super::activations`] measured), the slots that follow, and every shape
//! of step planned up front ([`StepTracker::prime`]): the plans' peaks are
//! the prediction, a placement that cannot fit fails before training, and
//! step 1 already prefetches. Runs once, before the engine exists; what it
//! settles becomes the [`StepSchedule`] and the move queue's slots.

use strata_runtime::{Runtime, Tier};
use strata_scheduler as sched;
use strata_scheduler::StepTracker;
use strata_storage::ByteSize;

use crate::error::{Result, TrainError, bad};

use super::activations::widen;
use super::config::{Checkpointing, StateCache, TrainConfig};
use super::env::Env;
use super::schedule::StepSchedule;
use super::steps::{eval_ops, shape_of, step_ops};
use super::tensors::{Kept, Slot, slots, specs, state_cache};
use super::{EVAL_SHAPES, Prediction, SHAPES};

/// Plans kept: one per shape of step and of forward-only pass.
const PLANS_MAX: usize = SHAPES + EVAL_SHAPES;

/// What planning settled: the schedule, the slots it planned, and the
/// groups whose states the state cache keeps.
pub(super) struct Planned {
    pub(super) schedule: StepSchedule,
    pub(super) slots: Vec<Slot>,
    pub(super) cache_groups: usize,
}

/// Every shape of step planned with one config: the tracker primed with
/// them, each shape's ops and its tensors' last uses, the peaks.
struct Shapes {
    tracker: StepTracker,
    shapes: Vec<(Vec<sched::StepOp>, Vec<usize>)>,
    peak_bytes: [u64; 3],
    cache_groups: usize,
    cache_bytes: u64,
}

/// The planning of one rank, over its surroundings.
pub(super) struct Planner<'a> {
    env: &'a Env,
    slots: Vec<Slot>,
    recompute: Vec<bool>,
    /// What the plans take one block's forward of one micro-batch to cost.
    block_ns: u64,
    /// The links the plans are costed with.
    links: sched::Links,
    /// Whether the first step's updates are speculative.
    speculate: bool,
    /// The device bytes held for compute buffers.
    workspace_bytes: u64,
}

impl<'a> Planner<'a> {
    pub(super) fn new(
        env: &'a Env,
        block_ns: u64,
        links: sched::Links,
        speculate: bool,
        workspace_bytes: u64,
    ) -> Planner<'a> {
        Planner {
            env,
            slots: Vec::new(),
            recompute: Vec::new(),
            block_ns,
            links,
            speculate,
            workspace_bytes,
        }
    }

    /// Settles which blocks recompute and plans every shape of step: with
    /// several candidates, each one's steady step is planned and simulated
    /// at the measured rates and the fastest whose plan fits is kept
    /// (`recompute::choose`'s model sees compute and PCIe, not the plan's
    /// own transfers); then, with `"auto"`, the recomputed blocks widen
    /// while the plans of every shape do not fit.
    pub(super) fn plan(mut self, mut candidates: Vec<Vec<bool>>, kept: Kept) -> Result<Planned> {
        if candidates.len() == 1 {
            let only = candidates.pop().expect("one candidate");
            self.use_recompute(only, kept);
        } else {
            let mut best: Option<(f64, Vec<bool>)> = None;
            for recompute in candidates {
                let Some(step_s) = self.simulated_step_s(&recompute, kept)? else {
                    continue;
                };
                tracing::info!(
                    "activations: {} of {} blocks recomputing, the plan simulates a step in {:.3} s",
                    recompute.iter().filter(|&&r| r).count(),
                    recompute.len(),
                    step_s
                );
                if best.as_ref().is_none_or(|(fastest, _)| step_s < *fastest) {
                    best = Some((step_s, recompute));
                }
            }
            let layers = self.env.model().layers();
            let recompute = best.map_or_else(|| vec![true; layers], |(_, r)| r);
            self.use_recompute(recompute, kept);
        }
        loop {
            let (planning, cache_groups, cache_bytes) = self.planning()?;
            match self.plan_with_cache(&planning, cache_groups, cache_bytes) {
                // The choice's rooms are estimates; the plans are the test.
                Err(TrainError::DoesNotFit { cause })
                    if self.env.config().train.checkpoint_activations == Checkpointing::Auto
                        && widen(&mut self.recompute) =>
                {
                    let recomputed = self.recompute.iter().filter(|&&r| r).count();
                    tracing::info!(
                        "activations: the plans do not fit ({cause}); {recomputed} blocks recompute"
                    );
                    let recompute = std::mem::take(&mut self.recompute);
                    self.use_recompute(recompute, kept);
                }
                planned => return Ok(self.planned(planned?)),
            }
        }
    }

    /// The schedule of the shapes planned.
    fn planned(self, planned: Shapes) -> Planned {
        let mut peak_bytes = planned.peak_bytes;
        peak_bytes[Tier::Device.index()] += self.workspace_bytes;
        peak_bytes[Tier::Host.index()] += planned.cache_bytes;
        let prediction = Prediction {
            peak_bytes,
            workspace_bytes: self.workspace_bytes,
            state_cache_bytes: planned.cache_bytes,
            recomputed_blocks: self.recompute.iter().filter(|&&r| r).count(),
        };
        Planned {
            schedule: StepSchedule::new(
                planned.tracker,
                planned.shapes,
                self.recompute,
                prediction,
            ),
            slots: self.slots,
            cache_groups: planned.cache_groups,
        }
    }

    /// Makes `recompute` the blocks that recompute, and the slots follow.
    fn use_recompute(&mut self, recompute: Vec<bool>, kept: Kept) {
        self.slots = slots(self.env.config(), self.env.groups(), kept, &recompute);
        self.recompute = recompute;
    }

    /// The plan's config for the slots as they are.
    fn planning(&self) -> Result<(sched::PlanConfig, usize, u64)> {
        plan_config(
            self.env.config(),
            self.env.runtime(),
            &self.slots,
            self.env.groups().len(),
            self.links,
        )
    }

    /// The simulated time of a steady step (the first shape) with
    /// `recompute`, or None when its plan does not fit.
    fn simulated_step_s(&mut self, recompute: &[bool], kept: Kept) -> Result<Option<f64>> {
        self.use_recompute(recompute.to_vec(), kept);
        let planning = self.planning()?.0;
        let ops = step_ops(
            self.env,
            &self.recompute,
            self.block_ns,
            0,
            self.speculate,
            false,
        );
        let trace = sched::Trace {
            tensors: specs(self.env.runtime(), &self.slots),
            ops: ops.into_iter().map(|s| s.op).collect(),
        };
        let plan = match sched::plan(&trace, &planning) {
            Ok(plan) => plan,
            Err(
                sched::SchedulerError::DoesNotFit { .. }
                | sched::SchedulerError::StagingDoesNotFit { .. }
                | sched::SchedulerError::InitialPlacement { .. },
            ) => return Ok(None),
            Err(err) => return Err(err.into()),
        };
        let simulated = sched::SimConfig {
            capacity_bytes: planning.capacity_bytes,
            links: planning.links,
            gathers_ahead_max: 2,
            timeline_points_max: 2,
        };
        Ok(Some(
            sched::simulate(&trace, &plan, &simulated)?.step_time_s,
        ))
    }

    /// Plans every shape of step with the state cache of `cache_groups`
    /// groups, or without it when "auto" does not fit it (an explicit size
    /// that does not fit is named as the problem).
    fn plan_with_cache(
        &self,
        plan_config: &sched::PlanConfig,
        cache_groups: usize,
        cache_bytes: u64,
    ) -> Result<Shapes> {
        match self.plan_shapes(plan_config, cache_groups, cache_bytes) {
            Err(TrainError::DoesNotFit { cause }) if cache_groups > 0 => {
                let mut full = plan_config.clone();
                full.capacity_bytes[Tier::Host.index()] += cache_bytes;
                let planned = self.plan_shapes(&full, 0, 0)?;
                if let StateCache::Bytes(bytes) = self.env.config().placement.state_cache {
                    return Err(bad(
                        "placement.state_cache",
                        ByteSize(bytes),
                        format!(
                            "the plans fit the host budget only without it ({cause}): lower it, or use \"auto\""
                        ),
                    ));
                }
                Ok(planned)
            }
            planned => planned,
        }
    }

    /// Lists and plans every shape of step with `config` (the host tier
    /// less the state cache of the first `cache_groups` groups'
    /// `cache_bytes`): their last uses, and the plans' peaks.
    fn plan_shapes(
        &self,
        config: &sched::PlanConfig,
        cache_groups: usize,
        cache_bytes: u64,
    ) -> Result<Shapes> {
        let runtime = self.env.runtime();
        let tensors = specs(runtime, &self.slots);
        let ops_max = 4 * tensors.len() + 16;
        let mut tracker = StepTracker::new(config.clone(), tensors.len(), ops_max, PLANS_MAX);
        for spec in &tensors {
            tracker.tensor(spec.clone())?;
        }
        let mut shapes = Vec::with_capacity(PLANS_MAX);
        let mut peak_bytes = [0u64; 3];
        for shape in 0..PLANS_MAX {
            let ops = match shape {
                ..SHAPES => {
                    let (current, speculate, late) = shape_of(shape);
                    step_ops(
                        self.env,
                        &self.recompute,
                        self.block_ns,
                        current,
                        speculate,
                        late,
                    )
                }
                // The forward-only passes (evaluations), after them.
                _ => eval_ops(self.env, self.block_ns, shape - SHAPES),
            };
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
            let plan = tracker.prime(&trace)?;
            let footprint = |t: usize, tier: sched::Tier| {
                runtime.footprint_bytes(self.slots[t].meta.len_bytes())[tier.index()]
            };
            let replayed = sched::replay_peak_bytes(&trace, plan, &footprint)
                .expect("the planner's plans replay");
            for (p, planned) in peak_bytes.iter_mut().zip(replayed) {
                *p = (*p).max(planned);
            }
            shapes.push((ops, last));
        }
        Ok(Shapes {
            tracker,
            shapes,
            peak_bytes,
            cache_groups,
            cache_bytes,
        })
    }
}

/// The planner's view of the rank's tiers, and the state cache (its groups
/// and bytes), which the plan leaves the host room for.
pub(super) fn plan_config(
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
